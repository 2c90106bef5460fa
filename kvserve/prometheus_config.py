"""`kvserve render prometheus`: a Prometheus scrape config for every component of a cluster.

One job per component kind, one static target per component, each labelled with what the
dashboards (deploy/grafana) select and group by:

    job kvserve-router       router           /metrics on router.metrics_port or router.port;
                                              with router.processes N > 1, one target per
                                              process (metrics_port + i, label process=i)
    job kvserve-prefill      every prefill    /metrics on metrics_port or port
    job kvserve-decode       every decode     /metrics on metrics_port or port
    job kvserve-unified      every unified    /metrics on metrics_port or port
    job kvserve-pool-master  Mooncake master  /metrics on pool.master.metrics_port
    job kvserve-pool-store   every store      /metrics on its metrics_port (stores without
                                              one get a port picked at start: not listed)

    labels: instance=<component name>  role=<kind>  node=<node name>  cluster=<name>

kvserve's own series carry `instance` (and `role`) labels equal to the target's, so the
kvserve jobs scrape with `honor_labels: true`: the component's labels are kept as they
are instead of being renamed to exported_instance. The pool jobs keep the default
(Mooncake's series carry no such labels; the target's are attached).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from kvpool.topology import master_component, master_nodes, store_component
from protocol.cluster import ClusterConfig, NodeConfig

JOB_PREFIX = "kvserve-"
KVSERVE_KINDS = ("router", "prefill", "decode", "unified")
"""Kinds whose series carry their own instance/role labels (honor_labels)."""


@dataclass(frozen=True)
class ScrapeTarget:
    """One component's /metrics endpoint and the labels Prometheus attaches to it."""

    kind: str
    """router | prefill | decode | unified | pool_master | pool_store (the job is
    kvserve-<kind>)."""
    name: str
    node: str
    address: str
    """host:port (IPv6 hosts in brackets)."""
    process: int | None = None
    """Which router process (router.processes > 1): its series differ from the other
    processes' only by this label, since the router's own carry `instance`."""

    @property
    def job(self) -> str:
        return JOB_PREFIX + self.kind.replace("_", "-")


def _address(node: NodeConfig, port: int, host: str | None = None) -> str:
    h = host or node.host
    if h in ("0.0.0.0", "::", ""):
        h = node.host  # a wildcard bind is scraped through the node's own address
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def scrape_targets(cluster: ClusterConfig) -> list[ScrapeTarget]:
    """Every component of `cluster` that serves /metrics, in job order."""
    r = cluster.router
    router_node = cluster.router_node
    if r.processes > 1 and r.metrics_port is not None:
        targets = [
            ScrapeTarget(
                "router",
                "router",
                router_node.name,
                _address(router_node, r.metrics_port + i, cluster.router_bind_host),
                process=i,
            )
            for i in range(r.processes)
        ]
    else:
        targets = [
            ScrapeTarget(
                "router",
                "router",
                router_node.name,
                _address(router_node, r.metrics_port or r.port, cluster.router_bind_host),
            )
        ]
    for p in cluster.prefill:
        node = cluster.node(p.node)
        targets.append(
            ScrapeTarget("prefill", p.name, node.name, _address(node, p.metrics_port or p.port))
        )
    for d in cluster.decode:
        node = cluster.node(d.node)
        targets.append(
            ScrapeTarget("decode", d.name, node.name, _address(node, d.metrics_port or d.port))
        )
    for u in cluster.unified:
        node = cluster.node(u.node)
        targets.append(
            ScrapeTarget("unified", u.name, node.name, _address(node, u.metrics_port or u.port))
        )
    pool = cluster.pool
    if pool is not None and pool.enabled:
        for node_name in master_nodes(cluster):
            node = cluster.node(node_name)
            name = master_component(cluster, node_name)
            targets.append(
                ScrapeTarget(
                    "pool_master", name, node_name, _address(node, pool.master.metrics_port)
                )
            )
        for i, store in enumerate(pool.stores):
            if store.metrics_port is not None:
                node = cluster.node(store.node)
                targets.append(
                    ScrapeTarget(
                        "pool_store",
                        store_component(i),
                        node.name,
                        _address(node, store.metrics_port),
                    )
                )
    return targets


def prometheus_config(cluster: ClusterConfig, scrape_interval: str = "15s") -> dict[str, object]:
    """The config as a dict: `global` intervals and one scrape job per component kind."""
    jobs: dict[str, dict[str, object]] = {}
    for t in scrape_targets(cluster):
        job = jobs.setdefault(
            t.job,
            {
                "job_name": t.job,
                "honor_labels": t.kind in KVSERVE_KINDS,
                "metrics_path": "/metrics",
                "static_configs": [],
            },
        )
        static = job["static_configs"]
        assert isinstance(static, list)
        labels = {"instance": t.name, "role": t.kind, "node": t.node, "cluster": cluster.name}
        if t.process is not None:
            labels["process"] = str(t.process)
        static.append({"targets": [t.address], "labels": labels})
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": list(jobs.values()),
    }


def render_prometheus(
    cluster: ClusterConfig, source: str | None = None, scrape_interval: str = "15s"
) -> str:
    """prometheus.yml text for `cluster`, with a header saying how it was made."""
    made_from = f" -c {source}" if source else ""
    header = (
        f"# Prometheus scrape config of kvserve cluster {cluster.name!r}.\n"
        f"# Generated by `kvserve render prometheus{made_from}`; regenerate it when the\n"
        "# cluster changes. Dashboards: deploy/grafana (docs/observability.md).\n"
    )
    body = yaml.safe_dump(
        prometheus_config(cluster, scrape_interval), sort_keys=False, default_flow_style=False
    )
    return header + body

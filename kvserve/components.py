"""What `kvserve up` starts on this host: one ComponentSpec per process, in start stages.

The command line of each component kind is a template (`DEFAULT_COMMANDS`), so tests and
operators can swap in another program without touching the launcher:

    {"prefill": ["{python}", "-m", "prefill_worker", "-c", "{config}", "--name", "{name}"]}

Placeholders: {python} {config} {name} {kind} {node} {host} {port} {index} ({index}: the
entry of pool.stores, stores only). A pool store's {port} is its HTTP /health port:
`metrics_port`, or a free port of its host picked here.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpool.topology import master_component, master_nodes, service_stores, store_component
from kvserve.bind_narrowing import narrowing_env
from protocol.cluster import ClusterConfig, NodeConfig, is_loopback_host
from protocol.config_errors import ConfigError
from protocol.internal_auth import SECRET_ENV

DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {
    "router": ("{python}", "-m", "router", "-c", "{config}"),
    "prefill": ("{python}", "-m", "prefill_worker", "-c", "{config}", "--name", "{name}"),
    "decode": ("{python}", "-m", "decode_worker", "-c", "{config}", "--name", "{name}"),
    "unified": ("{python}", "-m", "unified_worker", "-c", "{config}", "--name", "{name}"),
    "pool_master": ("{python}", "-m", "kvpool.master", "-c", "{config}", "--node", "{node}"),
    "pool_store": (
        "{python}",
        "-m",
        "kvpool.store",
        "-c",
        "{config}",
        "--index",
        "{index}",
        "--health-port",
        "{port}",
    ),
}
"""Command template per component kind."""

START_ORDER: tuple[tuple[str, ...], ...] = (
    ("pool_master",),
    ("pool_store",),
    ("prefill", "decode", "unified", "router"),
)
"""Kinds started together, stage by stage; a stage starts when the previous is healthy
(stores mount into a running master, prefill connects to a pool that has memory). The
router starts beside the workers (its imports and tokenizer load overlap theirs) and is
healthy once it sees every worker of the same launch answer (`ComponentSpec.waits_for`).
With `router.processes` > 1 it starts in a stage of its own after the workers instead:
its GET /health answers for whichever process took the connection, so it cannot show
that every process sees them, while each process that starts after them does before it
serves (router/health.py)."""

RESTARTED_KINDS = ("pool_master", "pool_store", "prefill", "decode", "unified")
"""Kinds the supervisor restarts when they exit once the cluster runs, instead of stopping
it: without the pool, prefill recomputes; without a worker, the router routes around it
(its in-flight requests fail fast with a 5xx, DESIGN §10) until it is back."""

WORKER_KINDS = ("prefill", "decode", "unified")

SECRET_KINDS = ("router", "prefill", "decode", "unified")
"""Kinds that get the cluster secret (protocol/internal_auth.py): they make or answer
internal calls. The pool's processes speak Mooncake's protocol and never see it."""

# The directory holding the kvserve package: children import the same checkout.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class ComponentSpec:
    """One process the launcher starts and supervises, fully resolved."""

    name: str
    kind: str
    node: str
    host: str
    """Address the component is reached at (its node's host)."""
    port: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the launcher's environment."""
    waits_for: tuple[str, ...] = ()
    """The router: the instances started with it (this launch's workers) that its GET
    /health must show healthy before it counts as started."""

    @property
    def restart(self) -> bool:
        """Restarted when it exits (see RESTARTED_KINDS) rather than ending the cluster."""
        return self.kind in RESTARTED_KINDS

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    @property
    def status_url(self) -> str | None:
        """GET /status → protocol.messages.InstanceStatus; workers only."""
        return f"{self.base_url}/status" if self.kind in WORKER_KINDS else None


def component_env(
    node: NodeConfig,
    dist_port: int | None,
    extra: Mapping[str, str],
    narrow_binds: bool = True,
) -> dict[str, str]:
    """Environment a component on `node` needs beyond the launcher's own.

    Mooncake advertises the host's first LAN address unless MC_TCP_BIND_ADDRESS is set,
    and gloo/NCCL pick an interface on their own; on a loopback node all of them must stay
    on `lo`. Mooncake's and torch.distributed's listeners bind the wildcard whatever they
    advertise: `narrow_binds` keeps them on the node's address (kvserve/bind_narrowing.py).
    Section `env` entries win over everything.
    """
    env = {
        "MC_TCP_BIND_ADDRESS": node.host,
        "MASTER_ADDR": node.host,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if is_loopback_host(node.host):
        # 127.0.0.2 etc. stay themselves: two "nodes" on one host (tests of a split pool)
        # are two loopback addresses, and Mooncake must advertise each node's own.
        addr = "127.0.0.1" if node.host == "localhost" else node.host
        env.update(
            MC_TCP_BIND_ADDRESS=addr,
            MASTER_ADDR=addr,
            GLOO_SOCKET_IFNAME="lo",
            NCCL_SOCKET_IFNAME="lo",
        )
    if dist_port is not None:
        env["MASTER_PORT"] = str(dist_port)
    if narrow_binds:
        env.update(narrowing_env(env["MC_TCP_BIND_ADDRESS"]))
    env.update(extra)
    return env


def with_secret(spec: ComponentSpec, secret: str) -> ComponentSpec:
    """`spec` with the cluster secret in its environment (never its argv: `ps` shows
    every user the command lines) when its kind needs it."""
    if spec.kind not in SECRET_KINDS:
        return spec
    return replace(spec, env={**spec.env, SECRET_ENV: secret})


def free_port(host: str) -> int:
    """A port of `host` free right now (the kernel's choice) for a component without one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def plan_components(
    cluster: ClusterConfig,
    config_path: str | Path,
    node_names: Sequence[str],
    commands: Mapping[str, Sequence[str]] | None = None,
) -> list[list[ComponentSpec]]:
    """The components of `node_names`, grouped into start stages (empty stages dropped)."""
    templates: dict[str, Sequence[str]] = {**DEFAULT_COMMANDS, **(commands or {})}
    config = str(Path(config_path).expanduser().resolve())
    selected = set(node_names)
    for name in selected:
        cluster.node(name)  # ConfigError naming the valid nodes
    by_kind: dict[str, list[ComponentSpec]] = {kind: [] for stage in START_ORDER for kind in stage}

    def spec(
        name: str,
        kind: str,
        node: NodeConfig,
        host: str,
        port: int,
        env: dict[str, str],
        index: int | None = None,
    ) -> ComponentSpec:
        if kind not in templates:
            raise ConfigError("", f"no command for component kind {kind!r}")
        values = dict(
            python=sys.executable,
            config=config,
            name=name,
            kind=kind,
            node=node.name,
            host=host,
            port=str(port),
            index="" if index is None else str(index),
        )
        argv = tuple(arg.format(**values) for arg in templates[kind])
        return ComponentSpec(name, kind, node.name, host, port, argv, env)

    pool = cluster.pool
    if pool is not None and pool.enabled:
        for node_name in master_nodes(cluster):
            node = cluster.node(node_name)
            if node.name in selected:
                env = component_env(node, None, {})
                name = master_component(cluster, node.name)
                port = pool.master.metrics_port
                by_kind["pool_master"].append(spec(name, "pool_master", node, node.host, port, env))
        for i, store in service_stores(cluster):  # a store in a prefill has no process
            node = cluster.node(store.node)
            if node.name in selected:
                env = component_env(node, None, {})
                port = store.metrics_port or free_port(node.host)
                by_kind["pool_store"].append(
                    spec(store_component(i), "pool_store", node, node.host, port, env, i)
                )

    for inst in cluster.prefill:
        node = cluster.node(inst.node)
        if node.name in selected:
            env = component_env(node, inst.dist_port, inst.env)
            by_kind["prefill"].append(spec(inst.name, "prefill", node, node.host, inst.port, env))
    for dec in cluster.decode:
        node = cluster.node(dec.node)
        if node.name in selected:
            env = component_env(node, dec.dist_port, dec.env)
            by_kind["decode"].append(spec(dec.name, "decode", node, node.host, dec.port, env))
    for uni in cluster.unified:
        node = cluster.node(uni.node)
        if node.name in selected:
            env = component_env(node, None, uni.env)
            by_kind["unified"].append(spec(uni.name, "unified", node, node.host, uni.port, env))
    router_node = cluster.router_node
    if router_node.name in selected:
        # The router binds exactly router.host (a wildcard there is the user's choice).
        env = component_env(router_node, None, cluster.router.env, narrow_binds=False)
        host = cluster.router_bind_host
        if host in ("0.0.0.0", "::"):
            host = router_node.host  # reachable from this node whatever the wildcard
        workers = tuple(s.name for kind in WORKER_KINDS for s in by_kind[kind])
        by_kind["router"].append(
            replace(
                spec("router", "router", router_node, host, cluster.router.port, env),
                waits_for=workers,
            )
        )
    stages = [[s for kind in stage for s in by_kind[kind]] for stage in START_ORDER]
    if cluster.router.processes > 1 and by_kind["router"]:
        stages[-1].remove(by_kind["router"][0])
        stages.append(by_kind["router"])
    return [stage for stage in stages if stage]

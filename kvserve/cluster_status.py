"""`kvserve status`: every component's GET /health (and /status for workers) as a table."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from kvserve.cluster_secret import secret_for_client
from kvserve.components import plan_components
from kvserve.health import ComponentHealth, fetch_status, format_table, http_get
from kvserve.process_groups import pid_alive
from kvserve.run_state import RunDir
from protocol.cluster import ClusterConfig, load_cluster
from protocol.internal_auth import auth_headers


def status(
    config_path: str | Path,
    state_dir: str | Path | None = None,
    nodes: Sequence[str] = (),
    timeout_s: float = 2.0,
    out: IO[str] = sys.stdout,
) -> int:
    """Print every component's health as a table; 0 if all are up, 1 otherwise."""
    cluster = load_cluster(config_path)
    run = RunDir(state_dir, cluster.name)
    state = run.read()
    pids = {c.name: c.pid for c in state.components} if state else {}
    selected = list(nodes) or [n.name for n in cluster.nodes]
    headers = auth_headers(secret_for_client(cluster, run))
    rows = []
    for stage in plan_components(cluster, config_path, selected):
        for spec in stage:
            probe = http_get(spec.health_url, timeout_s)
            info = (
                fetch_status(spec.status_url, timeout_s, headers)
                if spec.status_url and probe.ok
                else None
            )
            address = spec.base_url.removeprefix("http://")
            rows.append(
                ComponentHealth(
                    spec.name, spec.kind, spec.node, address, pids.get(spec.name), probe, info
                )
            )
            if spec.kind == "router":
                rows += _router_processes(cluster, spec.host, spec.node, timeout_s)
    if state is not None:
        since = time.strftime("%F %T", time.localtime(state.started_at))
        launcher = "alive" if pid_alive(state.launcher_pid, state.launcher_start_time) else "gone"
        print(
            f"cluster {cluster.name!r}: {state.phase} since {since}, launcher pid "
            f"{state.launcher_pid} ({launcher}), logs {run.logs}",
            file=out,
        )
    else:
        print(f"cluster {cluster.name!r}: no launcher on this host", file=out)
    if cluster.router_node.name in selected:
        print(f"endpoint: {cluster.api_base_url}", file=out)
    print(format_table(rows), file=out)
    num_down = sum(not r.up for r in rows)
    if num_down:
        print(f"{num_down} of {len(rows)} components are not up", file=out)
    return 1 if num_down else 0


def _router_processes(
    cluster: ClusterConfig, host: str, node: str, timeout_s: float
) -> list[ComponentHealth]:
    """With router.processes > 1, a row per process: its own /metrics port answers while
    it runs (the API port answers for whichever process takes the connection)."""
    r = cluster.router
    if r.processes <= 1 or r.metrics_port is None:
        return []
    rows = []
    for i in range(r.processes):
        address = (
            f"[{host}]:{r.metrics_port + i}" if ":" in host else f"{host}:{r.metrics_port + i}"
        )
        probe = http_get(f"http://{address}/metrics", timeout_s)
        rows.append(ComponentHealth(f"router/{i}", "router", node, address, None, probe, None))
    return rows

"""`python -m kvpool.master -c cluster.yaml --node NODE`: the pool's Mooncake master.

Replaces itself (exec) with the `mooncake_master` binary of the installed Mooncake, so
signals reach the master directly. Every port binds the node's host, never 0.0.0.0:
RPC on `pool.master.port`, /metrics and /health on `pool.master.metrics_port`; the HTTP
metadata server stays off (it binds 0.0.0.0 whatever it is told, MOONCAKE.md §3): every
client uses P2PHANDSHAKE instead. Eviction starts at `eviction_high_watermark` of the
pool and takes `eviction_ratio` of the objects per pass; reads hold `lease_ttl_s`
leases; a store whose heartbeats stop for `client_ttl_s` (rounded up to whole seconds)
leaves the pool.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path

from protocol.cluster import ClusterConfig, load_cluster

RPC_THREADS = 4


def master_binary() -> str:
    """Path of the mooncake_master binary shipped with the installed Mooncake wheel."""
    try:
        import mooncake

        bundled = Path(mooncake.__file__).parent / "mooncake_master"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError(
            "mooncake_master not found: install kvserve[cpu] (or [cuda]/[rocm]), which ships it"
        )
    return found


def master_argv(cluster: ClusterConfig, node: str, binary: str) -> list[str]:
    """The mooncake_master command line for the master on `node`."""
    assert cluster.pool is not None
    m = cluster.pool.master
    host = cluster.node(node).host
    return [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={m.port}",
        "--enable_http_metadata_server=false",
        f"--metrics_host={host}",
        f"--metrics_port={m.metrics_port}",
        f"--eviction_high_watermark_ratio={m.eviction_high_watermark}",
        f"--eviction_ratio={m.eviction_ratio}",
        f"--default_kv_lease_ttl={round(m.lease_ttl_s * 1000)}",
        f"--client_ttl={max(1, math.ceil(m.client_ttl_s))}",
        f"--rpc_thread_num={RPC_THREADS}",
        "--logtostderr",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpool.master")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--node", required=True, help="node whose master this is")
    args = ap.parse_args(argv)
    cluster = load_cluster(args.config)
    if cluster.pool is None:
        print("the cluster has no pool section", file=sys.stderr)
        return 2
    host = cluster.node(args.node).host
    os.environ["MC_TCP_BIND_ADDRESS"] = host
    try:
        binary = master_binary()
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 2
    cmd = master_argv(cluster, args.node, binary)
    print(f"[pool-master] exec {' '.join(cmd)}", flush=True)
    os.execv(binary, cmd)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m kvpool.store -c cluster.yaml --index I --health-port P`: one Store service.

Contributes `pool.stores[I].size` bytes of this host's DRAM to the pool: a Mooncake Store
client that mounts a segment of that size (no local buffer, P2PHANDSHAKE), then serves
GET /health and GET /metrics on the node's host until SIGTERM, when it unmounts.

Why our own process rather than the `mooncake_client` binary (both work, MOONCAKE.md §1.2):
- SIGTERM unmounts at once (`close`); mooncake_client exits without unmounting, so the
  master keeps routing reads to the dead segment (-800) for client_ttl;
- /health means "the segment is mounted", bound to the node's host, which the launcher
  waits for before starting the workers;
- a failed mount says what to do (huge pages not reserved, master unreachable) instead of
  a line in Mooncake's log; MC_TCP_BIND_ADDRESS is checked against the node's host;
- no dummy-client IPC socket and no RPC port we do not use.

NUMA: on a host with several NUMA nodes the process re-executes itself under
`numactl --cpunodebind=N --membind=N` (numa_node N), or says why it runs unbound.
Huge pages (`hugepages: true`): MC_STORE_USE_HUGEPAGE=1, the segment comes from reserved
huge pages, and a failure names what the kernel has reserved.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.errors import PoolConfigError, code_name
from kvpool.mooncake_backend import METADATA_SERVER, import_store, set_bind_address
from kvpool.topology import hugepage_report, master_address, numa_plan, store_component
from protocol.cluster import PoolStoreConfig, load_cluster
from protocol.cluster_types import format_bytes

log = logging.getLogger("kvpool.store")
_NUMA_ENV = "KVSERVE_STORE_NUMA_BOUND"


class StoreService:
    """Owns the mounted segment (a Mooncake Store client) and its HTTP endpoints."""

    def __init__(self, name: str, host: str, cfg: PoolStoreConfig, master: str, protocol: str):
        self.name = name
        self.host = host
        self.cfg = cfg
        self.master = master
        self.protocol = protocol
        self.store: Any = None
        self.started_at = time.time()

    def mount(self) -> None:
        """Connect to the master and mount the segment; SystemExit(2) with a reason."""
        if self.protocol == "rdma":
            # Without this Mooncake silently falls back to TCP when it finds no HCA.
            os.environ.setdefault("MC_FORCE_HCA", "1")
        if self.cfg.hugepages:
            os.environ["MC_STORE_USE_HUGEPAGE"] = "1"
            os.environ.setdefault("MC_STORE_HUGEPAGE_SIZE", "2MB")
        mod = import_store()
        self.store = mod.MooncakeDistributedStore()
        local = f"{self.host}:{self.cfg.port}" if self.cfg.port else self.host
        rc = self.store.setup(
            local,
            METADATA_SERVER,
            int(self.cfg.size),
            0,
            self.protocol,
            ",".join(self.cfg.rdma_devices),
            self.master,
        )
        if rc != 0:
            size = format_bytes(int(self.cfg.size))
            if self.cfg.hugepages:
                why = (
                    f"mounting {size} on huge pages failed ({code_name(rc)}): the kernel has "
                    f"{hugepage_report()}; reserve enough (vm.nr_hugepages, per NUMA node under "
                    "/sys/devices/system/node/nodeN/hugepages) or set hugepages: false"
                )
            else:
                why = (
                    f"mounting {size} failed ({code_name(rc)}): is the master at {self.master} "
                    "up, and is that much memory free on this host?"
                )
            raise SystemExit(f"[{self.name}] {why}")
        log.info(
            "%s: %s mounted as segment %s, master %s",
            self.name,
            format_bytes(int(self.cfg.size)),
            self.store.get_hostname(),
            self.master,
        )

    def health(self) -> tuple[int, dict[str, object]]:
        master_ok = self.store is not None and self.store.health_check() == 0
        body = {
            "name": self.name,
            "mounted_bytes": int(self.cfg.size) if self.store is not None else 0,
            "master": self.master,
            "master_reachable": master_ok,
            "segment": self.store.get_hostname() if self.store is not None else None,
        }
        return (200 if self.store is not None else 503), body

    def metrics_text(self) -> str:
        code, body = self.health()
        lbl = f'{{store="{self.name}"}}'
        return (
            "# TYPE kvserve_pool_store_segment_bytes gauge\n"
            f"kvserve_pool_store_segment_bytes{lbl} {body['mounted_bytes']}\n"
            "# TYPE kvserve_pool_store_up gauge\n"
            f"kvserve_pool_store_up{lbl} {1 if code == 200 else 0}\n"
        )

    def close(self) -> None:
        if self.store is not None:
            self.store.close()  # unmounts: the master stops placing objects here at once
            self.store = None


def _http_server(service: StoreService, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                code, body = service.health()
                data = json.dumps(body).encode()
                ctype = "application/json"
            elif self.path == "/metrics":
                code, data, ctype = 200, service.metrics_text().encode(), "text/plain"
            else:
                code, data, ctype = 404, b"not found", "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return ThreadingHTTPServer((service.host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m kvpool.store")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--index", type=int, required=True, help="entry of pool.stores")
    ap.add_argument("--health-port", type=int, help="HTTP /health and /metrics port")
    args = ap.parse_args(raw)
    cluster = load_cluster(args.config)
    pool = cluster.pool
    if pool is None or not 0 <= args.index < len(pool.stores):
        print(f"pool.stores has no entry {args.index}", file=sys.stderr)
        return 2
    cfg = pool.stores[args.index]
    if cfg.prefill is not None:
        print(
            f"pool.stores[{args.index}] is mounted in prefill {cfg.prefill!r}: the instance "
            "mounts it, no store service runs for it",
            file=sys.stderr,
        )
        return 2
    name = store_component(args.index)
    logging.basicConfig(
        level=cluster.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    host = cluster.node(cfg.node).host
    if os.environ.get(_NUMA_ENV) is None:
        plan = numa_plan(cfg.numa_node)
        log.info("%s: %s", name, plan.message)
        if plan.argv_prefix:
            os.environ[_NUMA_ENV] = "1"
            cmd = [*plan.argv_prefix, sys.executable, "-m", "kvpool.store", *raw]
            os.execvp(cmd[0], cmd)
    try:
        set_bind_address(host)
    except PoolConfigError as e:
        print(f"[{name}] {e}", file=sys.stderr)
        return 2
    service = StoreService(name, host, cfg, master_address(cluster, cfg.node), pool.protocol)
    port = args.health_port or cfg.metrics_port
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        service.mount()
    except SystemExit as e:
        print(str(e.code), file=sys.stderr)
        return 2
    server = _http_server(service, port) if port else None
    if server is not None:
        threading.Thread(target=server.serve_forever, name="store-http", daemon=True).start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if server is not None:
            server.shutdown()
        service.close()
        log.info("%s: unmounted, exiting", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m decode_worker -c cluster.yaml --name NAME`: run one decode instance."""

from __future__ import annotations

import argparse
import asyncio
import sys

from decode_worker.service import DecodeService
from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import build_engine, cpu_threads_per_engine, serve, setup_logging
from protocol.cluster import load_cluster
from transfer import LandingArena, TransportConfig, create_transport


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decode_worker")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    cluster = load_cluster(args.config)
    inst = cluster.decode_instance(args.name)
    node = cluster.node(inst.node)
    setup_logging(cluster.log_level, inst.name)
    if inst.tensor_parallel != 1:
        print("tensor_parallel > 1 is not implemented yet", file=sys.stderr)
        return 2
    engine = build_engine(
        cluster,
        device=inst.devices[0],
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=inst.max_num_seqs,
        cpu_threads=cpu_threads_per_engine(cluster, inst.node),
    )
    transport = create_transport(
        TransportConfig(name="mooncake", host=node.host, protocol=inst.transfer.protocol)
    )
    landing_bytes = int(inst.landing_memory) // 4096 * 4096
    arena = LandingArena(landing_bytes, transport)
    host = EngineHost(engine)
    service = DecodeService(
        inst.name,
        host,
        arena,
        admit_timeout_s=cluster.router.admission.wait_timeout_s,
        landing_ttl_s=cluster.router.request_timeout_s,
        num_devices=len(inst.devices),
    )
    serve_metrics_port(service.registry, node.host, inst.metrics_port)
    app = service.app()
    tasks: list[asyncio.Task[None]] = []

    @app.on_event("startup")
    async def _start() -> None:
        host.start()
        tasks.append(asyncio.create_task(service.reap_landing()))

    @app.on_event("shutdown")
    async def _stop() -> None:
        for t in tasks:
            t.cancel()
        host.stop()

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

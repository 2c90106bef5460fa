"""`python -m prefill_worker -c cluster.yaml --name NAME`: run one prefill instance."""

from __future__ import annotations

import argparse
import asyncio
import sys

from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import build_engine, cpu_threads_per_engine, serve, setup_logging
from prefill_worker.handoff import HandoffTable
from prefill_worker.pool_connector import build_pool_connector
from prefill_worker.service import PrefillService
from protocol.cluster import load_cluster
from transfer import HandoffSender, TransportConfig, create_transport

STAGING_BYTES = 64 * 1024**2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefill_worker")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    cluster = load_cluster(args.config)
    inst = cluster.prefill_instance(args.name)
    node = cluster.node(inst.node)
    setup_logging(cluster.log_level, inst.name)
    if inst.pipeline_parallel != 1:
        print("pipeline_parallel > 1 is not implemented yet", file=sys.stderr)
        return 2
    engine = build_engine(
        cluster,
        device=inst.devices[0],
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=inst.max_num_seqs,
        cpu_threads=cpu_threads_per_engine(cluster, inst.node),
        max_batched_tokens=inst.max_batched_tokens,
    )
    protocol = cluster.decode[0].transfer.protocol if cluster.decode else "tcp"
    transport = create_transport(
        TransportConfig(name="mooncake", host=node.host, protocol=protocol)
    )
    sender = HandoffSender(transport, STAGING_BYTES, device=engine.device)
    host = EngineHost(engine)
    service = PrefillService(
        inst.name,
        host,
        HandoffTable(sender, engine.runner.kv_caches),
        num_devices=len(inst.devices),
    )
    engine.set_kv_connector(
        build_pool_connector(cluster, inst, engine, service.registry, service.kv_reporter)
    )
    serve_metrics_port(service.registry, node.host, inst.metrics_port)
    app = service.app()

    @app.on_event("startup")
    async def _start() -> None:
        host.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        host.stop()
        engine.close()
        await asyncio.sleep(0)

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

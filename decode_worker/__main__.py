"""`python -m decode_worker -c cluster.yaml --name NAME`: run one decode instance."""

from __future__ import annotations

import asyncio
import sys

from decode_worker.service import DecodeService
from decode_worker.startup import start_ranks
from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import load_instance, serve
from transfer import LandingArena, TransportConfig, create_transport


def main(argv: list[str] | None = None) -> int:
    ctx = load_instance("decode", argv)
    cluster, node, info = ctx.cluster, ctx.node, ctx.info
    inst = cluster.decode_instance(ctx.instance.name)
    transport = create_transport(
        TransportConfig(name="mooncake", host=node.host, protocol=inst.transfer.protocol)
    )
    landing_bytes = int(inst.landing_memory) // 4096 * 4096
    arena = LandingArena(landing_bytes, transport)
    ranks = start_ranks(ctx.config_path, cluster, inst, info, arena)
    engine = ranks.engine
    host = EngineHost(engine)
    service = DecodeService(
        inst.name,
        host,
        arena,
        ranks=ranks.landings,
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
        ranks.stop()

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m prefill_worker -c cluster.yaml --name NAME`: run one prefill instance."""

from __future__ import annotations

import asyncio
import logging
import sys

from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import load_instance, serve
from prefill_worker.pool_connector import build_pool_connector
from prefill_worker.service import PrefillService
from prefill_worker.stages import start_stages
from transfer import TransportConfig, create_transport


def main(argv: list[str] | None = None) -> int:
    ctx = load_instance("prefill", argv)
    cluster, node, info = ctx.cluster, ctx.node, ctx.info
    inst = cluster.prefill_instance(ctx.instance.name)
    protocol = cluster.decode[0].transfer.protocol if cluster.decode else "tcp"
    transport = create_transport(
        TransportConfig(name="mooncake", host=node.host, protocol=protocol)
    )
    stages = start_stages(ctx.config_path, cluster, inst, info, transport)
    engine = stages.engine
    host = EngineHost(engine)
    service = PrefillService(
        inst.name,
        host,
        stages.handoffs,
        num_devices=len(inst.devices),
    )
    if inst.pipeline_parallel == 1:
        engine.set_kv_connector(
            build_pool_connector(cluster, inst, engine, service.registry, service.kv_reporter)
        )
    elif cluster.pool_enabled:
        logging.getLogger(__name__).warning(
            "%s: the KV pool is not used with pipeline_parallel > 1 yet (per-stage "
            "save/restore from the stage processes is not built); prompts are recomputed",
            inst.name,
        )
    serve_metrics_port(service.registry, node.host, inst.metrics_port)
    app = service.app()

    @app.on_event("startup")
    async def _start() -> None:
        host.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        host.stop()
        engine.kv_connector.close()
        stages.stop()
        await asyncio.sleep(0)

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

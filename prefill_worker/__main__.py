"""`python -m prefill_worker -c cluster.yaml --name NAME`: run one prefill instance."""

from __future__ import annotations

import asyncio
import sys

from engine.step_trace import StepTrace
from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import load_instance, serve
from prefill_worker.service import PrefillService
from prefill_worker.stages import handoff_faults, start_stages
from transfer import create_transport, handoff_transport_config


def main(argv: list[str] | None = None) -> int:
    ctx = load_instance("prefill", argv)
    cluster, node, info = ctx.cluster, ctx.node, ctx.info
    inst = cluster.prefill_instance(ctx.instance.name)
    protocol = cluster.decode[0].transfer.protocol if cluster.decode else "tcp"
    transport = create_transport(handoff_transport_config(protocol, node.host))
    stages = start_stages(ctx.config_path, cluster, inst, info, transport, ctx.secret)
    engine = stages.engine
    engine.trace = StepTrace.from_env(inst.name)  # KVSERVE_STEP_TRACE: off unless set
    host = EngineHost(engine, stall_timeout_s=cluster.engine_stall_timeout_s)
    if stages.children is not None:  # a rank / stage that dies fails the instance at once
        stages.children.on_lost = host.instance_lost
        host.probe_lost = stages.children.probe
    service = PrefillService(
        inst.name,
        host,
        stages.handoffs,
        ctx.secret,
        num_devices=len(inst.devices),
        faults=handoff_faults(inst),
        trace=engine.trace,
        landing_wait_s=inst.landing_wait_s,
    )
    stages.connect(cluster, inst, service.registry, service.kv_reporter)
    serve_metrics_port(service.registry, node.host, inst.metrics_port)
    app = service.app()

    @app.on_event("startup")
    async def _start() -> None:
        host.start()
        service.heap_trimmer.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        await service.heap_trimmer.stop()
        host.stop()
        engine.connector.close()
        engine.kv_worker.close()
        stages.stop()
        await asyncio.sleep(0)

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

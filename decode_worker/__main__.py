"""`python -m decode_worker -c cluster.yaml --name NAME`: run one decode instance."""

from __future__ import annotations

import asyncio
import sys

from decode_worker.ranks import landing_arena
from decode_worker.service import DecodeService
from decode_worker.startup import start_ranks
from engine.step_trace import StepTrace
from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import load_instance, serve
from transfer import create_transport, handoff_transport_config

QUARANTINE_MARGIN_S = 5.0
"""Beyond the transport's write timeout: a write still in flight has failed by then."""
LANDING_TTL_MARGIN_S = 60.0
"""Beyond the router's request timeout: covers clock skew between hosts."""


def main(argv: list[str] | None = None) -> int:
    ctx = load_instance("decode", argv)
    cluster, node, info = ctx.cluster, ctx.node, ctx.info
    inst = cluster.decode_instance(ctx.instance.name)
    transport_config = handoff_transport_config(inst.transfer.protocol, node.host)
    arena = landing_arena(inst, 0, create_transport(transport_config))
    ranks = start_ranks(ctx.config_path, cluster, inst, info, arena)
    engine = ranks.engine
    engine.trace = StepTrace.from_env(inst.name)  # KVSERVE_STEP_TRACE: off unless set
    host = EngineHost(engine, stall_timeout_s=cluster.engine_stall_timeout_s)
    if ranks.children is not None:  # a rank / stage that dies fails the instance at once
        ranks.children.on_lost = host.instance_lost
        host.probe_lost = ranks.children.probe
    service = DecodeService(
        inst.name,
        host,
        arena,
        ranks=ranks.landings,
        receiver=ranks.receiver,
        notify_url=f"http://{node.host}:{inst.port}/kv_notify",
        admit_timeout_s=cluster.router.admission.wait_timeout_s,
        quarantine_s=transport_config.write_timeout_s + QUARANTINE_MARGIN_S,
        secret=ctx.secret,
        landing_ttl_s=cluster.router.request_timeout_s + LANDING_TTL_MARGIN_S,
        num_devices=len(inst.devices),
        trace=engine.trace,
    )
    ranks.worker.on_scatter = service.metrics.scatter_seconds.observe
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
        ranks.receiver.close()
        ranks.stop()

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

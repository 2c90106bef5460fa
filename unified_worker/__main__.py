"""`python -m unified_worker -c cluster.yaml --name NAME`: run one unified instance.

One process, one engine: its CPU slice and threads from enginehost/cpu_plan.py (pure-decode
steps on one thread fewer: engine/step_threads.py), the
pool's connector (the prefill worker's PoolScheduler and PoolWorker over the whole
model: restores history, saves full chunks) as its only KV connector, no handoff.
"""

from __future__ import annotations

import asyncio
import sys

from engine.llm_engine import LLMEngine
from engine.step_threads import StepThreads
from engine.step_trace import StepTrace
from enginehost.host import EngineHost
from enginehost.metrics import serve_metrics_port
from enginehost.startup import engine_config, load_instance, serve, set_cpu_threads
from prefill_worker.pool_connector import build_pool_connector
from unified_worker.service import UnifiedService


def main(argv: list[str] | None = None) -> int:
    ctx = load_instance("unified", argv)
    cluster, node, info = ctx.cluster, ctx.node, ctx.info
    inst = cluster.unified_instance(ctx.instance.name)
    slot = set_cpu_threads(cluster, inst, 0)
    config = engine_config(
        cluster,
        device=inst.devices[0],
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=inst.max_num_seqs,
        max_batched_tokens=inst.max_batched_tokens,
        faults=inst.engine_faults,
    )
    engine = LLMEngine(info, config)
    engine.trace = StepTrace.from_env(inst.name)  # KVSERVE_STEP_TRACE: off unless set
    if slot is not None and slot.decode_threads not in (None, slot.threads):
        # pure-decode steps on fewer threads, the rest of the slice left to the request path
        engine.step_threads = StepThreads(slot.threads, slot.decode_threads)
    host = EngineHost(engine, stall_timeout_s=cluster.engine_stall_timeout_s)
    service = UnifiedService(inst.name, host, ctx.secret, num_devices=1, trace=engine.trace)
    pool, pool_worker = build_pool_connector(
        cluster,
        inst,
        engine.namespace,
        engine.layout,
        engine.config,
        service.registry,
        service.kv_reporter,
    )
    engine.set_kv_connector(pool, pool_worker)
    serve_metrics_port(service.registry, node.host, inst.metrics_port)
    app = service.app()

    @app.on_event("startup")
    async def _start() -> None:
        host.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        host.stop()
        engine.connector.close()
        engine.kv_worker.close()
        await asyncio.sleep(0)

    serve(app, node.host, inst.port, cluster.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

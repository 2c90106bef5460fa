"""The pipeline stages of a prefill instance (PP = N, protocol/parallel.py).

stage 0 (python -m prefill_worker: HTTP, the one scheduler, layers of stage 0)
    spawns stages 1.. (python -m prefill_worker.stages) and joins their process group
stage s: its layers [start_s, end_s) and their paged KV (same block ids everywhere), and
    its own KV connector worker (`stage_worker`): the pool's (PoolWorker: its own pool
    client and slot buffer, saving and restoring its layers' objects) and the handoff's
    (HandoffWorker: its own Mooncake transport, staging slots and sender threads, sending
    its layers' part of every handoff flow and telling decode directly). So pool and handoff bytes leave every stage's device in
    parallel, as DESIGN §4-5 ask. The parts are in CONNECTOR_PARTS order on every stage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.kv_connector import KVConnectorWorker
from engine.kv_connector_multi import MultiConnectorScheduler, MultiConnectorWorker
from engine.kv_identity import kv_namespace
from engine.llm_engine import LLMEngine
from engine.parallel.comm import init_parallel
from engine.parallel.pp_engine import build_pp_engine
from engine.parallel.procs import ChildProcesses, rendezvous
from enginehost.kv_events import KVReporter
from enginehost.startup import engine_config, set_cpu_threads
from kvpool.stats import StageCounters
from modelinfo.info import ModelInfo
from prefill_worker.handoff import HandoffScheduler, HandoffWorker
from prefill_worker.notify import HttpNotifier
from prefill_worker.pool_connector import build_pool_client, build_pool_connector
from prefill_worker.pool_worker import PoolWorker
from protocol.cluster import ClusterConfig, PrefillConfig
from protocol.device_budget import handoff_staging_bytes
from protocol.internal_auth import SECRET_ENV, secret_from_env
from protocol.kv_layout import KVLayout
from protocol.landing_capability import capability_key
from protocol.parallel import even_layer_split
from transfer import HandoffFaults, Transport

log = logging.getLogger(__name__)

"""Registered staging buffer of each stage, cut into slots (transfer/sender.py)."""

CONNECTOR_PARTS = ("pool", "handoff")
"""The KV connector's parts, in the order of the MultiConnector on every stage."""


def layer_split(inst: PrefillConfig, num_layers: int) -> tuple[int, ...]:
    return inst.layer_split or even_layer_split(num_layers, inst.pipeline_parallel)


@dataclass
class PrefillStages:
    """What stage 0 runs: the engine, the handoff's scheduler side (its table) and stage
    0's handoff worker, and the processes of stages 1.."""

    engine: LLMEngine
    handoffs: HandoffScheduler
    sender: HandoffWorker
    children: ChildProcesses | None

    def connect(
        self,
        cluster: ClusterConfig,
        inst: PrefillConfig,
        registry: CollectorRegistry,
        reporter: KVReporter | None,
    ) -> None:
        """Plug the instance's KV connector into the engine: the pool (scheduler side over
        every stage, stage 0's worker) and the handoff, in CONNECTOR_PARTS order."""
        e = self.engine
        pool, pool_worker = build_pool_connector(
            cluster, inst, e.namespace, e.layout, e.config, registry, reporter
        )
        e.set_kv_connector(
            MultiConnectorScheduler([pool, self.handoffs]),
            MultiConnectorWorker([pool_worker, self.sender]),
        )

    def stop(self) -> None:
        if self.children is not None:
            self.children.stop()


def full_layout(info: ModelInfo, config: EngineConfig) -> KVLayout:
    mc = info.config
    return KVLayout(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
        kind=mc.kv_kind,
        cache_dtype=config.kv_cache_dtype,
    )


def stage_worker(
    cluster: ClusterConfig,
    inst: PrefillConfig,
    info: ModelInfo,
    config: EngineConfig,
    stage: int,
    sender: HandoffWorker,
) -> KVConnectorWorker:
    """The KV connector worker of stage `stage` >= 1 (CONNECTOR_PARTS order): its pool
    worker on its own pool client, and its handoff sender."""
    split = layer_split(inst, info.config.num_layers)
    counters = StageCounters()
    client = build_pool_client(
        cluster,
        inst,
        kv_namespace(info, config, split),
        full_layout(info, config),
        counters,
        stage,
        torch.device(config.device),
    )
    return MultiConnectorWorker([PoolWorker(client, counters), sender])


def handoff_faults(inst: PrefillConfig) -> HandoffFaults | None:
    """The test-only injected handoff faults of cluster.yaml, if any."""
    f = inst.handoff_faults
    if f is None:
        return None
    return HandoffFaults(
        f.fail_prompt_tokens, f.write_delay_s, f.hold_prompt_tokens, f.hold_until_file
    )


def handoff_worker(inst: PrefillConfig, transport: Transport, secret: str) -> HandoffWorker:
    """A stage's handoff worker: staging slots on its transport, notices over HTTP with
    the cluster secret, landing capabilities checked with the key derived from it."""
    faults = handoff_faults(inst)
    # over cuda_ipc the slots are larger: fewer pieces (each a gather, a write and a
    # scatter of per-layer launches) for the same KV; counted in the GPU budget
    staging = handoff_staging_bytes("cuda_ipc" if transport.name == "cuda_ipc" else "tcp")
    return HandoffWorker(transport, staging, HttpNotifier(secret), faults, capability_key(secret))


def stage_engine_config(cluster: ClusterConfig, inst: PrefillConfig, stage: int) -> EngineConfig:
    """The EngineConfig of stage `stage`: the instance's limits and the prefill instances'
    admission rule (cache.prefill_admission: a prompt leaves at its first token, so its
    whole prompt is what it needs: engine/admission.py)."""
    return engine_config(
        cluster,
        device=inst.devices[stage],
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=inst.max_num_seqs,
        max_batched_tokens=inst.max_batched_tokens,
        faults=inst.engine_faults,
        admission=cluster.cache.prefill_admission,
    )


def start_stages(
    config_path: str,
    cluster: ClusterConfig,
    inst: PrefillConfig,
    info: ModelInfo,
    transport: Transport,
    secret: str,
) -> PrefillStages:
    """Stage 0's engine: the whole model here (PP 1), or a pipeline over spawned stages
    (they inherit the cluster secret `secret` in their environment)."""
    set_cpu_threads(cluster, inst, 0)
    config = stage_engine_config(cluster, inst, 0)
    sender = handoff_worker(inst, transport, secret)
    pp = inst.pipeline_parallel
    if pp == 1:
        return PrefillStages(
            LLMEngine(info, config), HandoffScheduler(1, inst.landing_wait_s), sender, None
        )
    split = layer_split(inst, info.config.num_layers)
    init_method = rendezvous(os.environ.get("MASTER_ADDR"), inst.dist_port)
    children = ChildProcesses(
        [stage_argv(config_path, inst.name, s, init_method) for s in range(1, pp)],
        "prefill stage",
        init_method,
    )
    ctx = init_parallel(0, pp, config.device, init_method)
    engine = build_pp_engine(info, config, ctx, split, depth=pp)
    log.info("PP %d: layer split %s, every stage is up", pp, list(split))
    return PrefillStages(engine, HandoffScheduler(pp, inst.landing_wait_s), sender, children)


def stage_secret() -> str:
    """A stage process's cluster secret, inherited from stage 0's environment."""
    secret = secret_from_env()
    if secret is None:
        raise SystemExit(f"prefill stage: {SECRET_ENV} is not set (stage 0 passes it on)")
    return secret


def stage_argv(config: str, name: str, stage: int, init_method: str) -> list[str]:
    """Command line of stage `stage` (>= 1), run by stage 0."""
    return [
        sys.executable,
        "-m",
        "prefill_worker.stages",
        "-c",
        config,
        "--name",
        name,
        "--stage",
        str(stage),
        "--init-method",
        init_method,
        "--parent-pid",
        str(os.getpid()),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m prefill_worker.stages ...`: one stage >= 1 of a prefill instance."""
    ap = argparse.ArgumentParser(prog="python -m prefill_worker.stages")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)

    from engine.parallel.comm import shutdown_parallel
    from engine.parallel.pp_runner import build_stage, serve_stage
    from engine.parallel.procs import die_with_parent
    from enginehost.startup import setup_logging
    from modelinfo.info import load_model_info
    from protocol.cluster import load_cluster
    from transfer import create_transport, handoff_transport_config

    die_with_parent(args.parent_pid)
    cluster = load_cluster(args.config)
    inst = cluster.prefill_instance(args.name)
    node = cluster.node(inst.node)
    setup_logging(cluster.log_level, f"{inst.name}.stage{args.stage}")
    set_cpu_threads(cluster, inst, args.stage)
    config = stage_engine_config(cluster, inst, args.stage)
    pp = inst.pipeline_parallel
    ctx = init_parallel(args.stage, pp, config.device, args.init_method)
    try:
        info = load_model_info(cluster.model)
        split = layer_split(inst, info.config.num_layers)
        stage = build_stage(info, config, ctx, split)
        protocol = cluster.decode[0].transfer.protocol if cluster.decode else "tcp"
        transport = create_transport(handoff_transport_config(protocol, node.host))
        sender = handoff_worker(inst, transport, stage_secret())
        worker = stage_worker(cluster, inst, info, config, args.stage, sender)
        log.info("stage %d ready: layers %s", args.stage, stage.layers)
        serve_stage(stage, ctx, worker, pp)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

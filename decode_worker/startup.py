"""Rank 0 of a decode instance brings up its engine: in this process alone (TP 1), or
over TP ranks it spawns (decode_worker/ranks.py) and joins in one process group; then
plugs in the handoff receiver (decode_worker/receiver.py) as the engine's KV connector."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import msgspec

from decode_worker.ranks import RankLandings, rank_argv, rank_landing
from decode_worker.receiver import HandoffReceiver, LandingWorker
from engine.llm_engine import LLMEngine
from engine.parallel.comm import init_parallel, recv_bytes
from engine.parallel.procs import ChildProcesses, rendezvous
from engine.parallel.tp_runner import build_tp_engine
from enginehost.startup import cpu_threads_per_engine, engine_config, set_cpu_threads
from modelinfo.info import ModelInfo
from protocol.cluster import ClusterConfig, DecodeConfig
from protocol.parallel import decode_rank_shards
from protocol.rank_messages import RankLanding
from transfer import LandingArena

log = logging.getLogger(__name__)


@dataclass
class DecodeRanks:
    """What rank 0 runs: the engine, the ranks' landings, the handoff receiver (the
    engine's KV connector) with rank 0's worker, and the processes of ranks 1.."""

    engine: LLMEngine
    landings: RankLandings
    receiver: HandoffReceiver
    worker: LandingWorker
    children: ChildProcesses | None

    def stop(self) -> None:
        """Stop ranks 1.. (they would also die with this process)."""
        if self.children is not None:
            self.children.stop()


def start_ranks(
    config_path: str,
    cluster: ClusterConfig,
    inst: DecodeConfig,
    info: ModelInfo,
    arena: LandingArena,
) -> DecodeRanks:
    tp, dcp = inst.tensor_parallel, inst.decode_context_parallel
    mc = info.config
    shards = decode_rank_shards(mc.num_heads, mc.num_kv_heads, tp, dcp)
    set_cpu_threads(inst.devices[0], cpu_threads_per_engine(cluster, inst.node))
    config = engine_config(
        cluster,
        device=inst.devices[0],
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=inst.max_num_seqs,
        faults=inst.engine_faults,
    )
    children = None
    if tp == 1:
        engine = LLMEngine(info, config)
        layout = engine.layout
        remote: list[RankLanding] = []
    else:
        init_method = rendezvous(os.environ.get("MASTER_ADDR"), inst.dist_port)
        children = ChildProcesses(
            [rank_argv(config_path, inst.name, r, init_method) for r in range(1, tp)],
            "decode rank",
            init_method,
        )
        ctx = init_parallel(0, tp, config.device, init_method, dcp_size=dcp)
        engine, executor = build_tp_engine(info, config, ctx, tp, dcp)
        layout = executor.rank.layout
        remote = [
            msgspec.msgpack.decode(recv_bytes(r, ctx.cpu_group), type=RankLanding)
            for r in range(1, tp)
        ]
        log.info("TP %d x DCP %d: every rank is up (%s)", tp, dcp, [s.rank for s in shards])
    landings = RankLandings(arena, layout, shards, [rank_landing(0, arena), *remote])
    stripes = [(s.dcp_size, s.dcp_rank) for s in shards]
    receiver = HandoffReceiver(arena, len(shards), layout, stripes)
    worker = LandingWorker(arena, layout, 0, receiver)
    engine.set_kv_connector(receiver, worker)
    return DecodeRanks(engine, landings, receiver, worker, children)

"""The ranks of a decode instance (TP x DCP, protocol/parallel.py) and their landing
buffers.

    rank 0 (python -m decode_worker: HTTP, scheduler, rank 0's shard)
        spawns ranks 1.. (python -m decode_worker.ranks), joins their process group,
        receives each rank's RankLanding (transfer peer, landing buffer address)
    every rank: its own Mooncake transport, landing buffer of landing_memory bytes, and
        KV connector worker (decode_worker/receiver.py LandingWorker) that scatters its
        segments of every landed piece into its pages, before the step's forward

One landing region per request, at the SAME offset in every rank's buffer (rank 0's
arena allocates it, sized for the rank with the most tokens, at most a share of the
arena: longer prompts stream through it as a ring), so one LandingInfo per rank is just
base_r + offset.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from protocol.cluster import DecodeConfig
from protocol.kv_layout import KVLayout
from protocol.messages import LandingInfo
from protocol.parallel import DecodeRankShard, landing_region_max
from protocol.rank_messages import RankLanding, encode
from transfer import LandingArena, LandingRegion, Transport, rank_landing_bytes

log = logging.getLogger(__name__)


class RankLandings:
    """Rank 0's view of the instance: every rank's shard, cache layout and landing buffer;
    sizes regions and describes them to prefill. Pure."""

    def __init__(
        self,
        arena: LandingArena,
        layout: KVLayout,
        shards: list[DecodeRankShard],
        landings: list[RankLanding],
    ) -> None:
        self.arena, self.layout, self.shards = arena, layout, shards
        self.landings = landings

    @property
    def num_ranks(self) -> int:
        return len(self.shards)

    def region_bytes(self, num_prompt_tokens: int) -> int:
        """One region size for every rank: that of the rank holding the most tokens."""
        return max(
            rank_landing_bytes(self.layout, s.dcp_size, s.dcp_rank, num_prompt_tokens)
            for s in self.shards
        )

    def landing_infos(self, region: LandingRegion) -> list[LandingInfo]:
        return [
            LandingInfo(
                rank=s.rank,
                transport=lr.transport,
                peer=lr.peer,
                buffer_addr=lr.base_addr + region.offset_bytes,
                capacity_bytes=region.nbytes,
                layout=self.layout,
                kv_head_start=s.kv_head_start,
                dcp_size=s.dcp_size,
                dcp_rank=s.dcp_rank,
            )
            for s, lr in zip(self.shards, self.landings, strict=True)
        ]


def landing_bytes(inst: DecodeConfig) -> int:
    """Every rank's landing buffer: landing_memory, in whole 4 KiB pages."""
    return int(inst.landing_memory) // 4096 * 4096


def landing_arena(inst: DecodeConfig, rank: int, transport: Transport) -> LandingArena:
    """Rank `rank`'s landing arena: landing_memory on landing_device, regions capped at
    landing_region (a quarter of the arena by default)."""
    nbytes = landing_bytes(inst)
    region = None if inst.landing_region is None else int(inst.landing_region)
    return LandingArena(
        nbytes,
        transport,
        device=landing_device(inst, rank),
        max_region_bytes=landing_region_max(nbytes, region),
    )


def landing_device(inst: DecodeConfig, rank: int) -> str:
    """Where rank `rank`'s landing buffer lives: on its GPU when the handoff is cuda_ipc
    (prefill writes GPU to GPU, the scatter is a device copy), else pinned host memory."""
    device = inst.device_names[rank]
    return device if inst.transfer.protocol == "cuda_ipc" and device != "cpu" else "cpu"


def rank_landing(rank: int, arena: LandingArena) -> RankLanding:
    assert arena.transport is not None
    return RankLanding(
        rank, arena.transport.name, arena.transport.peer_address, arena.base_addr, arena.total_bytes
    )


def rank_argv(config: str, name: str, rank: int, init_method: str) -> list[str]:
    """Command line of rank `rank` (>= 1), run by rank 0."""
    return [
        sys.executable,
        "-m",
        "decode_worker.ranks",
        "-c",
        config,
        "--name",
        name,
        "--rank",
        str(rank),
        "--init-method",
        init_method,
        "--parent-pid",
        str(os.getpid()),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m decode_worker.ranks ...`: one rank >= 1 of a decode instance."""
    ap = argparse.ArgumentParser(prog="python -m decode_worker.ranks")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)

    from decode_worker.receiver import LandingWorker
    from engine.parallel.comm import init_parallel, send_bytes, shutdown_parallel
    from engine.parallel.procs import die_with_parent
    from engine.parallel.tp_runner import build_tp_rank, serve_rank
    from enginehost.startup import (
        engine_config,
        set_cpu_threads,
        setup_logging,
    )
    from modelinfo.info import load_model_info
    from protocol.cluster import load_cluster
    from transfer import create_transport, handoff_transport_config

    die_with_parent(args.parent_pid)
    cluster = load_cluster(args.config)
    inst = cluster.decode_instance(args.name)
    node = cluster.node(inst.node)
    setup_logging(cluster.log_level, f"{inst.name}.rank{args.rank}")
    device = inst.devices[args.rank]
    set_cpu_threads(cluster, inst, args.rank)
    config = engine_config(
        cluster,
        device=device,
        kv_cache_bytes=int(inst.kv_cache_memory),
        max_num_seqs=1,
        faults=inst.engine_faults,
    )
    ctx = init_parallel(
        args.rank,
        inst.tensor_parallel,
        config.device,
        args.init_method,
        dcp_size=inst.decode_context_parallel,
    )
    try:
        rank = build_tp_rank(
            load_model_info(cluster.model),
            config,
            ctx,
            inst.tensor_parallel,
            inst.decode_context_parallel,
        )
        transport = create_transport(handoff_transport_config(inst.transfer.protocol, node.host))
        arena = landing_arena(inst, args.rank, transport)
        send_bytes(encode(rank_landing(args.rank, arena)), 0, ctx.cpu_group)
        log.info("rank %d ready: %s", args.rank, rank.shard)
        worker = LandingWorker(arena, rank.layout, args.rank)
        serve_rank(rank, ctx, None, worker)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

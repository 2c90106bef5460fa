"""Decode TP x DCP: the driver's executor (rank 0) and the loop of every other rank.

    rank 0 (engine thread)                        rank r >= 1 (serve_rank)
    LLMEngine.step ─▶ TPExecutor.execute_step     loop:
        build_batch ── broadcast RankStep ──────▶     RankStep    -> connector loads,
        connector loads, forward (its shard,             forward (its shard), connector
          collectives), connector saves ◀──────▶          saves; collectives with every rank
        logits of the sampled rows (rank 0 only)
        every rank's connector report ◀── send ───    its report (when want_reports)
    decode admission ─▶ run_command ── RankCommand ▶  RankCommand -> command_hook, then
        command_hook here, all-reduce of failures ◀─▶  the same all-reduce (an ack)
    close ── Shutdown ─────────────────────────────▶  return

Every message goes to every rank in one order (broadcast), so ranks never disagree on
what runs next. After each forward the ranks agree whether it failed anywhere
(engine/parallel/rank_isolation.py: a rank whose forward raised completes the step's
remaining collectives with zeros first, so a failure of one rank alone never leaves the
others in a collective). A failed step leaves the ranks in step: each skips its saves
and report, and the driver bisects the step with probe runs every rank takes part in
(engine/step_isolation.py). A collective that itself fails (a rank process died) takes
the instance down as a whole (the driver watches its children).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from engine.attention.base import LSEAttentionBackend, get_backend
from engine.config import EngineConfig
from engine.faults import EngineFaults, InjectedFault
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnectorWorker, NoConnectorWorker, WorkerPlace
from engine.kv_connector_guard import guarded
from engine.kv_identity import torch_dtype
from engine.llm_engine import LLMEngine
from engine.parallel.comm import ParallelContext, broadcast_bytes, recv_bytes, send_bytes
from engine.parallel.rank_isolation import forward_agreeing
from engine.parallel.step_inputs import batch_tensors, build_batch
from engine.parallel.tp_model import TPLlamaModel
from engine.scheduler import ScheduledRequest
from engine.step_isolation import ForwardFailed
from engine.weights.cache import open_weights
from modelinfo.info import ModelInfo
from protocol.kv_layout import KVLayout
from protocol.parallel import DecodeRankShard, decode_rank_shards
from protocol.rank_messages import (
    RankCommand,
    RankMessage,
    RankStep,
    Shutdown,
    StepBatch,
    encode,
)

log = logging.getLogger(__name__)

CommandHook = Callable[[bytes, list[torch.Tensor]], str | None]
"""(worker payload, this rank's kv caches) -> None, or why it failed. Runs on every rank."""

_decoder = msgspec.msgpack.Decoder(RankMessage)  # type: ignore[arg-type]


@dataclass
class TPRank:
    """One rank's model shard and paged KV, as built by `build_tp_rank`."""

    shard: DecodeRankShard
    model: TPLlamaModel
    layout: KVLayout
    """This rank's cache: all layers, its group's KV heads, `block_size`-token blocks."""
    num_blocks: int
    kv_caches: list[torch.Tensor]

    @property
    def place(self) -> WorkerPlace:
        return WorkerPlace(0, self.layout.num_layers, shard=self.shard)


def build_tp_rank(
    info: ModelInfo, config: EngineConfig, ctx: ParallelContext, tp: int, dcp: int
) -> TPRank:
    """Load this rank's shard and allocate its cache. `config.block_size` is the cache's
    (local) block size; the driver's scheduler counts block_size * dcp tokens per block."""
    mc = info.config
    shard = decode_rank_shards(mc.num_heads, mc.num_kv_heads, tp, dcp)[ctx.rank]
    dtype = torch_dtype(config.dtype)
    lse = get_backend("torch_lse") if dcp > 1 else None
    assert lse is None or isinstance(lse, LSEAttentionBackend)
    model = TPLlamaModel(
        mc, shard, ctx, dtype=dtype, backend=get_backend(config.attention_backend), lse_backend=lse
    )
    # Read tensor by tensor: a rank keeps only its slice of each (a MoE checkpoint whole in
    # host memory per rank would not fit).
    model.load_weights(open_weights(info.source.kind, info.source.path, mc, config.cache_dir))
    layout = KVLayout(
        num_layers=mc.num_layers,
        num_kv_heads=shard.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
        kind=mc.kv_kind,
        cache_dtype=config.kv_cache_dtype,
    )
    num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // layout.bytes_per_block)
    shape = layout.cache_shape(num_blocks)
    store = torch_dtype(layout.storage_dtype)
    caches = [torch.zeros(shape, dtype=store, device=ctx.device) for _ in range(mc.num_layers)]
    return TPRank(shard, model, layout, num_blocks, caches)


class TPExecutor:
    """The driver's ModelExecutor for a TP x DCP instance: owns rank 0's shard and cache,
    sends every step and command to the other ranks. Engine thread only."""

    def __init__(
        self,
        rank: TPRank,
        ctx: ParallelContext,
        command_hook: CommandHook | None,
        faults: EngineFaults | None = None,
    ):
        assert ctx.is_driver
        self.rank, self.ctx, self.command_hook = rank, ctx, command_hook
        self.faults = faults
        self.kv_caches = rank.kv_caches
        self.num_blocks = rank.num_blocks
        self.layer_split: tuple[int, ...] = (rank.layout.num_layers,)
        self.kv_worker: KVConnectorWorker = NoConnectorWorker()
        self._want_reports = False
        self._closed = False

    def set_kv_worker(self, worker: KVConnectorWorker) -> None:
        """Rank 0's connector worker; from now on every step gathers every rank's report."""
        self.kv_worker = worker
        self._want_reports = True
        worker.register_kv_caches(self.kv_caches, self.rank.place)

    def execute(self, scheduled: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor | None:
        return self.execute_step(scheduled, kv, b"")[0]

    def execute_step(
        self,
        scheduled: list[ScheduledRequest],
        kv: KVCacheManager,
        kv_meta: bytes,
        *,
        load: bool = True,
        probe: bool = False,
    ) -> tuple[torch.Tensor | None, list[bytes]]:
        batch, rows = build_batch(scheduled, kv)
        fault = ""
        if self.faults is not None and scheduled:
            try:
                self.faults.check("forward", (s.request.params for s in scheduled))
            except InjectedFault as e:
                fault = str(e)
        want = self._want_reports and not probe
        where = self.faults.rank if self.faults is not None else None
        msg = RankStep(
            batch,
            kv_meta,
            want,
            load=load,
            probe=probe,
            fault=fault,
            fault_rank=-1 if where is None else where,
            fault_layer=self.faults.layer if self.faults is not None else 0,
        )
        hidden, reports = self._step(msg)
        if not rows or hidden is None:
            return None, reports
        idx = torch.tensor(rows, dtype=torch.long, device=self.ctx.device)
        return self.rank.model.compute_logits(hidden.index_select(0, idx)), reports

    def poll_kv(self, kv_meta: bytes) -> list[bytes]:
        empty = StepBatch([], [], [0], [], [])
        return self._step(RankStep(empty, kv_meta, self._want_reports))[1]

    def _step(self, msg: RankStep) -> tuple[torch.Tensor | None, list[bytes]]:
        """ForwardFailed when this rank's forward failed (every rank's did, alike)."""
        broadcast_bytes(encode(msg), self.ctx.cpu_group)
        hidden, report, error = _run_step(self.rank, self.ctx, self.kv_worker, msg)
        reports = [report] + [b""] * (self.ctx.world_size - 1)
        if msg.want_reports:
            others = [recv_bytes(r, self.ctx.cpu_group) for r in range(1, self.ctx.world_size)]
            reports = [report, *others]
        if error is not None:
            raise ForwardFailed(error)
        return hidden, reports

    def run_command(self, payload: bytes) -> None:
        """Run a worker command on every rank (this one too) before the next step;
        RuntimeError if it failed anywhere (each rank logs its own reason)."""
        broadcast_bytes(encode(RankCommand(payload)), self.ctx.cpu_group)
        error = _run_hook(self.command_hook, payload, self.kv_caches)
        if error is not None:
            log.error("rank 0: command failed: %s", error)
        if _any_failed(error is not None, self.ctx) or error is not None:
            raise RuntimeError(f"a decode rank failed a command: {error or 'see rank logs'}")

    def close(self) -> None:
        """Tell the other ranks to exit (idempotent)."""
        if not self._closed:
            self._closed = True
            broadcast_bytes(encode(Shutdown()), self.ctx.cpu_group)


def _run_step(
    rank: TPRank, ctx: ParallelContext, worker: KVConnectorWorker, msg: RankStep
) -> tuple[torch.Tensor | None, bytes, str | None]:
    """Connector loads, this rank's shard of the forward (none for an empty step),
    connector saves: (hidden states, this rank's connector report, None); when the
    forward raised: (None, b"", why), nothing saved, the report left for the next run."""
    if msg.load and not msg.probe:
        worker.start_loads(msg.kv_meta)
    hidden = None
    if msg.batch.positions:
        ids, positions, meta = batch_tensors(
            msg.batch, ctx.device, rank.layout.block_size, ctx.dcp_size, rank.shard.dcp_rank
        )
        assert ids is not None, "decode ranks embed: the step must carry input ids"
        mine = msg.fault_rank in (-1, ctx.rank)

        def before_layer(i: int) -> None:
            if msg.fault and mine and msg.fault_rank != -1 and i == msg.fault_layer:
                raise InjectedFault(msg.fault)

        def forward() -> torch.Tensor:
            if msg.fault and msg.fault_rank == -1:
                raise InjectedFault(msg.fault)
            return rank.model(ids, positions, rank.kv_caches, meta, before_layer)

        # the ranks agree on whether it failed anywhere (one rank alone too): the driver
        # then bisects the step (engine/parallel/rank_isolation.py)
        hidden, error = forward_agreeing(
            ctx, forward, lambda: rank.model.collectives(len(msg.batch.positions))
        )
        if error is not None:
            if not msg.probe:
                log.warning("rank %d: the step's forward failed: %s", ctx.rank, error)
            return None, b"", error
    if msg.probe:
        return hidden, b"", None
    worker.start_saves(msg.kv_meta)
    return hidden, worker.get_finished(), None


def _run_hook(hook: CommandHook | None, payload: bytes, caches: list[torch.Tensor]) -> str | None:
    if hook is None:
        return "this rank has no command hook"
    try:
        return hook(payload, caches)
    except Exception as e:  # reported to rank 0 through the ack, never kills the rank
        log.exception("command failed")
        return f"{type(e).__name__}: {e}"


def _any_failed(failed: bool, ctx: ParallelContext) -> bool:
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return bool(flag.item())


def serve_rank(
    rank: TPRank,
    ctx: ParallelContext,
    command_hook: CommandHook | None,
    worker: KVConnectorWorker | None = None,
) -> None:
    """The loop of rank >= 1: run what rank 0 broadcasts until Shutdown. `worker`: this
    rank's KV connector worker (None: off); closed on return."""
    assert not ctx.is_driver
    worker = guarded(worker or NoConnectorWorker())  # a failed call fails requests only
    worker.register_kv_caches(rank.kv_caches, rank.place)
    try:
        _serve(rank, ctx, command_hook, worker)
    finally:
        worker.close()


def _serve(
    rank: TPRank, ctx: ParallelContext, command_hook: CommandHook | None, worker: KVConnectorWorker
) -> None:
    while True:
        msg = _decoder.decode(broadcast_bytes(None, ctx.cpu_group))
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, RankStep):
            _, report, _error = _run_step(rank, ctx, worker, msg)
            if msg.want_reports:
                send_bytes(report, 0, ctx.cpu_group)
        else:
            error = _run_hook(command_hook, msg.payload, rank.kv_caches)
            if error is not None:
                log.error("rank %d: command failed: %s", ctx.rank, error)
            _any_failed(error is not None, ctx)


def build_tp_engine(
    info: ModelInfo,
    config: EngineConfig,
    ctx: ParallelContext,
    tp: int,
    dcp: int,
    command_hook: CommandHook | None = None,
) -> tuple[LLMEngine, TPExecutor]:
    """The driver's engine over a TP x DCP instance (the other ranks run serve_rank).
    `config.block_size` is each rank's cache block; the scheduler's is block_size * dcp."""
    rank = build_tp_rank(info, config, ctx, tp, dcp)
    executor = TPExecutor(rank, ctx, command_hook, config.faults)
    engine_config = msgspec.structs.replace(
        config, block_size=config.block_size * dcp, num_blocks=rank.num_blocks
    )
    return LLMEngine(info, engine_config, runner=executor), executor

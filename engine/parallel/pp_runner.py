"""Prefill PP = N: the driver's executor (stage 0) and the loop of every other stage.

The stages form a ring; every step travels it once, and several steps are on it at once:

    stage 0 (driver)              stage 1 ... stage N-2            stage N-1
    submit(step k):               recv StageStep + hidden          recv StageStep + hidden
      loads, its layers, saves ─▶   loads, its layers, saves  ─▶     loads, layers, saves,
      isend StageStep + hidden      isend (its report added)         logits of the sampled
    ...submit(step k+1) while                                        rows, sample
       the others run step k   ◀──────────── StageResult (tokens, every stage's report) ──┘
    collect() -> StageResult of the oldest step

"loads" and "saves" are the stage's KV connector worker (engine/kv_connector.py):
start_loads(meta) before the stage's layers, start_saves(meta) and get_finished() after,
so each stage moves its own layers' KV from its own process, all stages in parallel. A
step without tokens (a connector poll) skips the layers and carries no hidden states.
A stage whose layers fail finds the requests that make them fail, skips them with the
stages after it and drops their saves and sends (engine/parallel/pp_isolation.py).

Each stage owns its layers' paged KV with the same block ids (one scheduler, in the
driver). Steps reach every stage in order, so a block freed and reused by a later step is
always written after the earlier step read it. Sends are asynchronous (Outbox); no link
ever has more than `depth` undelivered steps, because the driver keeps at most `depth`
steps in flight, so a wait on an old send never blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import count

import msgspec
import torch
import torch.distributed as dist

from engine.attention.base import get_backend
from engine.config import EngineConfig
from engine.faults import EngineFaults
from engine.grammar import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnectorWorker, NoConnectorWorker, WorkerPlace
from engine.kv_connector_guard import guarded
from engine.kv_identity import torch_dtype
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from engine.parallel.comm import Outbox, ParallelContext, recv_bytes
from engine.parallel.pp_isolation import KnownCulprits, forward_isolating, stage_forward
from engine.sampler import Sampler, SamplerOutput, SamplingState
from engine.scheduler import ScheduledRequest
from engine.step_isolation import sample_isolating
from engine.weights.cache import load_weights
from modelinfo.info import ModelInfo
from protocol.kv_layout import KVLayout
from protocol.parallel import stage_layer_ranges
from protocol.rank_messages import (
    SampleRow,
    Shutdown,
    StageMessage,
    StageResult,
    StageStep,
    StepBatch,
    encode,
)

log = logging.getLogger(__name__)

_step_decoder = msgspec.msgpack.Decoder(StageMessage)  # type: ignore[arg-type]
_result_decoder = msgspec.msgpack.Decoder(StageResult)


@dataclass
class PPStage:
    """One stage's layers and their paged KV, as built by `build_stage`."""

    index: int
    num_stages: int
    layers: tuple[int, int]
    model: LlamaForCausalLM
    layout: KVLayout
    num_blocks: int
    kv_caches: list[torch.Tensor]
    info: ModelInfo | None = None
    """The model's metadata: the last stage compiles grammars with its tokenizer."""
    faults: EngineFaults | None = None
    """Injected per-request faults, tests only (engine/faults.py)."""

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def place(self) -> WorkerPlace:
        return WorkerPlace(self.layers[0], self.layers[1], self.index, self.num_stages)

    def run(
        self,
        worker: KVConnectorWorker,
        step: StageStep,
        batch: StepBatch,
        known: KnownCulprits,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, bytes, list[tuple[int, str]]]:
        """One step on this stage: connector loads, its layers (none for an empty step)
        over the sequences not known to fail, connector saves without the culprits';
        (hidden states out, this stage's connector report, the step's culprits so far:
        upstream's and those whose forward failed here, engine/parallel/pp_isolation.py).
        `batch`: the step's batch with input ids on the first stage."""
        worker.start_loads(step.kv_meta)
        out = None
        culprits = list(step.culprits)
        skip = known.skipped(step.step_id, batch, step.request_ids, step.culprits)
        if batch.positions:
            device = self.kv_caches[0].device
            forward = stage_forward(
                self.model,
                self.kv_caches,
                device,
                self.layout.block_size,
                self.faults,
                self.index,
                step.poisoned,
            )
            out, found = forward_isolating(
                forward,
                batch,
                hidden,
                skip,
                self.model.config.hidden_size,
                self.model.dtype,
                device,
            )
            for b, err in sorted(found.items()):
                log.warning(
                    "stage %d: the forward of %s failed: %s", self.index, step.request_ids[b], err
                )
            culprits += sorted(found.items())
            skip.update(found)
        known.remember(step.step_id, batch, step.request_ids, [b for b, _ in culprits])
        meta = step.kv_meta
        if skip:
            meta = worker.without_requests(meta, {step.request_ids[b] for b in skip})
        worker.start_saves(meta)
        return out, worker.get_finished(), culprits


def stage_num_blocks(config: EngineConfig, info: ModelInfo, layer_split: tuple[int, ...]) -> int:
    """Blocks every stage gets: what the stage with the most layers can hold in
    kv_cache_bytes (all stages share block ids, so they have the same count)."""
    if config.num_blocks:
        return config.num_blocks
    mc = info.config
    widest = KVLayout(
        num_layers=max(layer_split),
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
        kind=mc.kv_kind,
        cache_dtype=config.kv_cache_dtype,
    )
    return max(1, config.kv_cache_bytes // widest.bytes_per_block)


def build_stage(
    info: ModelInfo, config: EngineConfig, ctx: ParallelContext, layer_split: tuple[int, ...]
) -> PPStage:
    """Load stage ctx.rank's layers (only its tensors are read) and allocate its cache."""
    mc = info.config
    start, end = stage_layer_ranges(layer_split)[ctx.rank]
    is_first, is_last = start == 0, end == mc.num_layers
    own = tuple(f"model.layers.{i}." for i in range(start, end))

    def want(name: str) -> bool:
        if name.startswith("model.layers."):
            return name.startswith(own)
        if name == "model.embed_tokens.weight":
            return is_first or (is_last and mc.tie_word_embeddings)
        return is_last

    weights = load_weights(info.source.kind, info.source.path, mc, config.cache_dir, want=want)
    dtype = torch_dtype(config.dtype)
    model = build_model(
        mc,
        dtype=dtype,
        device=ctx.device,
        backend=get_backend(config.attention_backend),
        layer_start=start,
        layer_end=end,
        weights=weights,
    )
    layout = KVLayout(
        num_layers=end - start,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
        kind=mc.kv_kind,
        cache_dtype=config.kv_cache_dtype,
    )
    num_blocks = stage_num_blocks(config, info, layer_split)
    shape = layout.cache_shape(num_blocks)
    store = torch_dtype(layout.storage_dtype)
    caches = [torch.zeros(shape, dtype=store, device=ctx.device) for _ in range(end - start)]
    return PPStage(
        ctx.rank,
        len(layer_split),
        (start, end),
        model,
        layout,
        num_blocks,
        caches,
        info,
        config.faults,
    )


class PipelineExecutor:
    """The driver's side of the ring: owns stage 0's layers and cache, puts steps on the
    ring and takes their results off it in order. Engine thread only."""

    def __init__(
        self,
        stage: PPStage,
        ctx: ParallelContext,
        layer_split: tuple[int, ...],
        depth: int,
    ) -> None:
        assert ctx.is_driver and len(layer_split) >= 2
        self.stage, self.ctx, self.depth = stage, ctx, depth
        self.kv_worker: KVConnectorWorker = NoConnectorWorker()
        self.kv_caches = stage.kv_caches
        self.num_blocks = stage.num_blocks
        self.layer_split = layer_split
        self._to_next = Outbox(1)
        self._step_ids = count()
        self._closed = False
        self._known = KnownCulprits(depth, stage.layout.block_size)

    def execute(self, scheduled: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor | None:
        raise NotImplementedError("a pipeline runs through PipelinedEngine.step (submit/collect)")

    def set_kv_worker(self, worker: KVConnectorWorker) -> None:
        """Stage 0's connector worker (the other stages build their own)."""
        self.kv_worker = worker
        worker.register_kv_caches(self.kv_caches, self.stage.place)

    def submit(
        self,
        batch: StepBatch,
        samples: list[SampleRow],
        kv_meta: bytes,
        request_ids: list[str] | None = None,
        poisoned: list[int] | None = None,
    ) -> int:
        """Run stage 0's part of the step (connector loads, its layers, connector saves)
        and pass the step on. Returns the step id that collect() will return it under.
        A batch without tokens is a connector poll: no layers, no hidden states.
        `request_ids`: each sequence's request; `poisoned`: test-only (StageStep)."""
        step_id = next(self._step_ids)
        header = StageStep(
            step_id,
            msgspec.structs.replace(batch, input_ids=[]),
            samples,
            kv_meta,
            [],
            request_ids or [],
            [],
            poisoned or [],
        )
        hidden, report, culprits = self.stage.run(self.kv_worker, header, batch, self._known)
        header = msgspec.structs.replace(header, reports=[report], culprits=culprits)
        self._to_next.send(encode(header), self.ctx.cpu_group, hidden, None)
        self._to_next.drain(self.depth)
        return step_id

    def collect(self) -> StageResult:
        """The result of the oldest step still on the ring (waits for it)."""
        return _result_decoder.decode(recv_bytes(self.stage.num_stages - 1, self.ctx.cpu_group))

    def close(self) -> None:
        """Send Shutdown around the ring (idempotent)."""
        if not self._closed:
            self._closed = True
            self._to_next.send(encode(Shutdown()), self.ctx.cpu_group)
            self._to_next.drain()


def serve_stage(
    stage: PPStage, ctx: ParallelContext, worker: KVConnectorWorker | None, depth: int
) -> None:
    """The loop of stage >= 1: run each step that arrives until Shutdown. `worker`: this
    stage's KV connector worker (None: off); closed on return."""
    assert not ctx.is_driver
    worker = guarded(worker or NoConnectorWorker())  # a failed call fails requests only
    worker.register_kv_caches(stage.kv_caches, stage.place)
    try:
        _serve(stage, ctx, worker, depth)
    finally:
        worker.close()


def _serve(stage: PPStage, ctx: ParallelContext, worker: KVConnectorWorker, depth: int) -> None:
    prev = ctx.rank - 1
    out = Outbox(0 if stage.is_last else ctx.rank + 1)
    sampler = Sampler()
    grammars: GrammarCompiler | None = None
    hidden_size = stage.model.config.hidden_size
    known = KnownCulprits(depth, stage.layout.block_size)
    while True:
        msg = _step_decoder.decode(recv_bytes(prev, ctx.cpu_group))
        if isinstance(msg, Shutdown):
            if not stage.is_last:
                out.send(encode(msg), ctx.cpu_group)
            out.drain()
            return
        num_tokens = len(msg.batch.positions)
        hidden: torch.Tensor | None = None
        if num_tokens:
            hidden = torch.empty(
                num_tokens, hidden_size, dtype=stage.model.dtype, device=ctx.device
            )
            dist.recv(hidden, prev)
        hidden, report, culprits = stage.run(worker, msg, msg.batch, known, hidden)
        reports = [*msg.reports, report]
        if stage.is_last:
            if grammars is None and any(s.params.grammar for s in msg.samples):
                assert stage.info is not None, "the last stage needs the tokenizer for grammars"
                info = stage.info
                grammars = GrammarCompiler(
                    info.tokenizer, info.config.vocab_size, info.eos_token_ids
                )
            result, failed = _sample(stage, sampler, hidden, msg.samples, ctx.device, grammars)
            tops = result.top_logprobs if any(result.top_logprobs) else None
            out.send(
                encode(
                    StageResult(
                        msg.step_id,
                        result.token_ids,
                        result.logprobs,
                        reports,
                        tops,
                        sorted(failed.items()),
                        [(msg.request_ids[b], err) for b, err in culprits],
                    )
                ),
                ctx.cpu_group,
            )
        else:
            forward = msgspec.structs.replace(msg, reports=reports, culprits=culprits)
            out.send(encode(forward), ctx.cpu_group, hidden, None)
        out.drain(depth)


def _sample(
    stage: PPStage,
    sampler: Sampler,
    hidden: torch.Tensor | None,
    samples: list[SampleRow],
    device: torch.device,
    grammars: GrammarCompiler | None,
) -> tuple[SamplerOutput, dict[int, str]]:
    if not samples or hidden is None:
        return SamplerOutput([], [], []), {}
    idx = torch.tensor([s.row for s in samples], dtype=torch.long, device=device)
    logits = stage.model.compute_logits(hidden.index_select(0, idx))
    return sample_rows(sampler, logits, samples, grammars, stage.faults)


def sample_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    samples: list[SampleRow],
    grammars: GrammarCompiler | None,
    faults: EngineFaults | None = None,
) -> tuple[SamplerOutput, dict[int, str]]:
    """Sample a step's rows as LLMEngine does, from what SampleRow carries; (output,
    {row: error} of rows that failed alone: engine/step_isolation.py). A row under a
    grammar gets a fresh state synced to its output tokens (none for a prefill's first
    token; the compiled grammar itself is cached by the compiler)."""
    states = []
    for s in samples:
        grammar = None
        if s.params.grammar is not None:
            assert grammars is not None, "a grammar row needs the stage's GrammarCompiler"
            grammar = grammars.new_state(s.params.grammar)
        states.append(
            SamplingState(
                s.params,
                s.num_output_tokens,
                None,
                s.eos_token_ids,
                s.prompt_token_ids,
                s.output_token_ids,
                grammar,
            )
        )
    return sample_isolating(sampler, logits, states, faults)

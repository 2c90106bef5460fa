"""PipelinedEngine: LLMEngine over a prefill pipeline, with up to `depth` steps in flight.

    step():  issue   schedule (requests waiting for a sampled token are paused; the
                     KV connector's step metadata) -> advance their progress, cache full
                     blocks -> PipelineExecutor.submit (stage 0 computes now, the ring
                     later; every stage runs its connector worker around its layers)
             collect when `depth` steps are in flight or nothing new can run:
                     the oldest step's sampled tokens and every stage's connector
                     report (loads done on every stage, blocks released) -> outputs

With nothing to compute but connector metadata to deliver (a load to start) or transfers
outstanding, an empty step goes around the ring: every stage's worker gets the metadata
and reports, no layer runs.

So stage 0 computes step k+1 while stage 1 computes step k, and so on down the ring: a
long prompt's chunks (which do not sample until the last) fill the pipeline one after
another. A request whose step samples is paused until its token is back; its token is
dropped if it was aborted or preempted meanwhile. Progress advances when a step is
issued: every stage computes steps in order, so a later step (or another request's
prefix-cache hit on these blocks) always finds the KV in place. A step's result names
the requests whose forward failed on a stage (engine/parallel/pp_isolation.py): they
fail alone, the prefix cache forgets the blocks the step computed for them, and a
request that took a hit on those blocks meanwhile fails too (its KV is not valid).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_connector import KVConnectorScheduler, KVConnectorWorker
from engine.kv_connector_guard import guarded
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.parallel.comm import ParallelContext
from engine.parallel.pp_runner import PipelineExecutor, build_stage
from engine.parallel.step_inputs import build_batch
from engine.request import Request
from engine.step_execution import LOAD_POLL_S
from modelinfo.info import ModelInfo
from protocol.ids import BlockId, RequestId
from protocol.rank_messages import SampleRow, StepBatch


@dataclass
class _InFlight:
    step_id: int
    sampling: list[tuple[Request, int]]
    """Requests this step samples, with their preemption count when it was issued."""
    kv_meta: bytes = b""
    """The connector's metadata of the step (a culprit's saves are then not expected)."""
    starts: dict[RequestId, int] = field(default_factory=dict)
    """Each computed request's first token of the step (a culprit's blocks from there on
    hold KV that is not valid on the stage that failed and those after it)."""


class PipelinedEngine(LLMEngine):
    """Owns the steps in flight on a pipeline (PP >= 2); everything else is LLMEngine's.
    The KV connector's driver worker runs on stage 0 (PipelineExecutor.set_kv_worker)."""

    def __init__(self, info: ModelInfo, config: EngineConfig, executor: PipelineExecutor) -> None:
        super().__init__(info, config, runner=executor)
        self.pipeline = executor
        self.depth = executor.depth
        self._in_flight: deque[_InFlight] = deque()

    def set_kv_connector(self, scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> None:
        """The connector's scheduler side, and stage 0's worker (stages 1.. build theirs)."""
        assert not self.scheduler.has_work(), "set the connector before adding requests"
        self.connector = scheduler
        self.scheduler.connector = scheduler
        scheduler.bind_block_pool(self.pool)
        worker = guarded(worker)  # its calls fail requests, not the step
        self.kv_worker = worker
        self.pipeline.set_kv_worker(worker)

    def has_unfinished(self) -> bool:
        """Steps still on the ring count: their results must be collected, in order."""
        return super().has_unfinished() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        issued = len(self._in_flight) < self.depth and self._issue()
        if self._in_flight and (len(self._in_flight) >= self.depth or not issued):
            return self._complete(self._in_flight.popleft())
        return []

    def _issue(self) -> bool:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return self._issue_poll(plan.kv_meta)
        batch, rows = build_batch(plan.scheduled, self.kv)
        sampling = [s.request for s in plan.scheduled if s.samples]
        samples = [_sample_row(row, r) for row, r in zip(rows, sampling, strict=True)]
        starts = {s.request.request_id: s.request.num_computed_tokens for s in plan.scheduled}
        for s in plan.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)
        for r in sampling:
            self.scheduler.paused.add(r.request_id)
        faults = self.config.faults
        poisoned = None
        if faults is not None and faults.place == "forward":
            poisoned = faults.poisoned(s.request.params for s in plan.scheduled)
        step_id = self.pipeline.submit(
            batch, samples, plan.kv_meta, [str(rid) for rid in starts], poisoned
        )
        self._in_flight.append(
            _InFlight(step_id, [(r, r.num_preemptions) for r in sampling], plan.kv_meta, starts)
        )
        return True

    def _issue_poll(self, kv_meta: bytes) -> bool:
        """Nothing to compute: an empty step carries the connector's metadata (always, so
        nothing it planned is lost) or, with transfers outstanding and the ring idle, polls
        every stage's worker after a short wait."""
        if not kv_meta:
            if self._in_flight or not self.connector.has_pending():
                return False
            self.kv_worker.wait(LOAD_POLL_S)
        empty = StepBatch([], [], [0], [], [])
        step_id = self.pipeline.submit(empty, [], kv_meta)
        self._in_flight.append(_InFlight(step_id, []))
        return True

    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        result = self.pipeline.collect()
        assert result.step_id == flight.step_id, "the ring returns steps in order"
        reports, failing = self.split_reports(result.reports)  # engine/kv_connector_guard.py
        culprits = [(rid, f"forward failed: {err}") for rid, err in result.culprits]
        culprits += failing.items()
        outputs = self._fail_culprits(flight, culprits) if culprits else []
        self.apply_reports(reports)
        tops = result.top_logprobs or [None] * len(result.token_ids)
        failed = dict(result.failed)
        for i, ((req, epoch), token, logprob, top) in enumerate(
            zip(flight.sampling, result.token_ids, result.logprobs, tops, strict=True)
        ):
            self.scheduler.paused.discard(req.request_id)
            live = self._requests.get(req.request_id) is req and not req.status.finished
            if not (live and req.num_preemptions == epoch):
                continue
            if i in failed:
                outputs.append(self.fail_request(req, f"sampling failed: {failed[i]}"))
            else:
                outputs.append(self.append_isolating(req, token, logprob, top))
        return outputs

    def _fail_culprits(
        self, flight: _InFlight, culprits: list[tuple[str, str]]
    ) -> list[RequestOutput]:
        """Requests whose forward failed on a stage of this step fail alone
        (engine/parallel/pp_isolation.py), as do those a failed KV connector call of the
        step named (engine/kv_connector_guard.py), and so does a request that took a prefix hit
        on the blocks the step was computing for them (their KV is not valid on the
        stage that failed and those after it, which skip such a request too). Before the
        step's reports are applied: the connector stops expecting their saves, of this
        step and of those still on the ring."""
        failing: dict[RequestId, tuple[Request, str]] = {}
        invalid: set[BlockId] = set()
        for rid, err in culprits:
            req = self._requests.get(RequestId(rid))
            if req is None or req.status.finished:
                continue
            start = flight.starts.get(req.request_id, req.num_computed_tokens)
            blocks = self.kv.block_table(req.request_id)[start // self.config.block_size :]
            self.pool.uncache(blocks)
            invalid.update(blocks)
            failing[req.request_id] = (req, err)
        why = "its prompt prefix was being computed by a request whose step failed"
        for req in self._requests.values():
            if req.request_id not in failing and invalid.intersection(
                self.kv.block_table(req.request_id)
            ):
                failing[req.request_id] = (req, why)
        ids = {str(rid) for rid, _ in culprits} | {str(rid) for rid in failing}
        for f in (flight, *self._in_flight):
            self.connector.without_requests(f.kv_meta, ids)  # accounting: result unused
        return [self.fail_request(req, err) for req, err in failing.values()]

    def abort_all(self) -> int:
        """Abort every request; steps in flight are still collected (and their tokens
        dropped) so the ring stays in step with the driver."""
        n = super().abort_all()
        try:
            while self._in_flight:
                self._complete(self._in_flight.popleft())
        finally:
            self._in_flight.clear()
            self.scheduler.paused.clear()
        return n


def build_pp_engine(
    info: ModelInfo,
    config: EngineConfig,
    ctx: ParallelContext,
    layer_split: tuple[int, ...],
    depth: int | None = None,
) -> PipelinedEngine:
    """The driver's engine over a pipeline of len(layer_split) stages (the others run
    pp_runner.serve_stage). depth: steps in flight, default one per stage."""
    stage = build_stage(info, config, ctx, layer_split)
    executor = PipelineExecutor(stage, ctx, layer_split, depth or len(layer_split))
    return PipelinedEngine(info, config, executor)


def _sample_row(row: int, r: Request) -> SampleRow:
    """What the last stage needs to sample r's row as LLMEngine would: the token lists
    travel only when a penalty or grammar reads them."""
    p = r.params
    reads_output = p.grammar is not None or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return SampleRow(
        row,
        p,
        r.num_output_tokens,
        tuple(r.eos_token_ids),
        tuple(r.prompt_token_ids) if p.repetition_penalty != 1.0 else (),
        tuple(r.output_token_ids) if reads_output or p.repetition_penalty != 1.0 else (),
    )

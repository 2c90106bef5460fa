"""LLMEngine: the small API both workers drive (add_request / step / abort).

step():  schedule   scheduler.schedule(): the batch and the KV connector's step metadata
         execute    the connector's workers start loads, the model runs (here, or on the
                    ranks / stages of a parallel instance), the workers start saves and
                    report what finished
         update     progress advances, full blocks are cached, the workers' reports go to
                    the connector (loads done, blocks released), sampled tokens are
                    appended, finished requests leave -> RequestOutput per request

KV moves in and out only through the KV connector (engine/kv_connector.py), set with
`set_kv_connector`; with none the engine runs the "off" connector.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import count
from typing import Protocol, runtime_checkable

import torch

from engine.attention.base import get_backend
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import (
    KVConnectorScheduler,
    KVConnectorWorker,
    NoConnectorWorker,
    WorkerPlace,
)
from engine.kv_connector_guard import guarded
from engine.kv_connector_guard import split_reports as split_failures
from engine.kv_identity import kv_namespace, torch_dtype
from engine.model_runner import ModelExecutor, ModelRunner
from engine.models.registry import build_model
from engine.outputs import Completion, RequestOutput
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, SamplingState, TopLogprobs
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerCounters, SchedulerOutput
from engine.step_isolation import ForwardFailed, describe, find_culprits, sample_isolating
from engine.step_threads import StepThreads
from engine.step_trace import Row, StepTrace
from engine.weights.cache import load_weights
from modelinfo.detokenizer import RequestOutputText
from modelinfo.info import ModelInfo, load_model_info
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.hashing import namespace_seed
from protocol.ids import RequestId
from protocol.kv_layout import KVLayout
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.02
"""Longest the engine thread waits for a transfer when nothing else can run (it then goes
back to its inbox: new requests and aborts are not held up longer than this)."""


@runtime_checkable
class ConnectorExecutor(Protocol):
    """A runner whose KV connector workers live in several processes (the ranks of a
    TP x DCP instance): it carries the step's connector metadata to every one of them and
    brings their reports back. Engine thread only."""

    def set_kv_worker(self, worker: KVConnectorWorker) -> None:
        """The driver process's own worker side (the other processes build theirs)."""
        ...

    def execute_step(
        self,
        scheduled: list[ScheduledRequest],
        kv: KVCacheManager,
        kv_meta: bytes,
        *,
        load: bool = True,
        probe: bool = False,
    ) -> tuple[torch.Tensor | None, list[bytes]]:
        """Run one step everywhere: (logits as ModelExecutor.execute, one connector
        report per process in rank order). ForwardFailed when every process's forward
        failed (then nothing was saved and the reports wait for the next run). `load`:
        start the connector's loads of kv_meta (False when a failed run did); `probe`:
        the forward only, for bisection (no connector, no reports)."""
        ...

    def poll_kv(self, kv_meta: bytes) -> list[bytes]:
        """A step with nothing to compute: every worker gets `kv_meta` and reports."""
        ...


class LLMEngine:
    """Owns one model instance with its KV cache, scheduler, sampler and live requests."""

    def __init__(
        self, info: ModelInfo, config: EngineConfig, runner: ModelExecutor | None = None
    ) -> None:
        """`runner`: what runs the model (engine/parallel/ for PP or TP x DCP instances);
        None builds a ModelRunner in this process. A given runner decides num_blocks."""
        self.info = info
        self.config = config
        mc = info.config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.layout = KVLayout(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            dtype=config.dtype,
            kind=mc.kv_kind,
            cache_dtype=config.kv_cache_dtype,
        )
        self.runner: ModelExecutor = runner if runner is not None else self._local_runner()
        self.namespace = kv_namespace(info, config, self.runner.layer_split)
        self._hash_root = namespace_seed(self.namespace.key())
        num_blocks = self.runner.num_blocks
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            order=PrefillOrder(
                kind=config.prefill_order,
                bound_steps=config.prefill_bound_steps,
            ),
        )
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(info.tokenizer, mc.vocab_size, info.eos_token_ids)
        """Compiles requests' grammars (structured output) on its own thread, cached."""
        self._texts: dict[RequestId, RequestOutputText] = {}
        self._requests: dict[RequestId, Request] = {}
        self._ids = count()
        self.connector: KVConnectorScheduler = self.scheduler.connector
        """The KV connector's scheduler side (engine/kv_connector.py)."""
        self.kv_worker: KVConnectorWorker = NoConnectorWorker()
        """This process's worker side of the KV connector."""
        self.trace: StepTrace | None = None
        """Where steps are recorded (engine/step_trace.py); None: not recorded."""
        self.step_threads: StepThreads | None = None
        """Torch threads per kind of step on the CPU (engine/step_threads.py); None:
        torch's count for every step."""

    def _local_runner(self) -> ModelRunner:
        """The whole model and its cache in this process."""
        mc, config = self.info.config, self.config
        weights = load_weights(self.info.source.kind, self.info.source.path, mc, config.cache_dir)
        backend = get_backend(config.attention_backend)
        model = build_model(
            mc, dtype=self.dtype, device=self.device, backend=backend, weights=weights
        )
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_bytes // self.layout.bytes_per_block
        )
        return ModelRunner(
            model,
            self.layout,
            num_blocks,
            device=self.device,
            dtype=self.dtype,
            backend=backend,
            cuda_graphs=config.cuda_graphs,
            compile_layers=config.compile_layers,
            max_batch=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    @classmethod
    def from_spec(cls, model: str, config: EngineConfig | None = None) -> LLMEngine:
        """Load a model by path or `builtin:` name and build an engine for it."""
        return cls(load_model_info(model), config or EngineConfig())

    def set_kv_connector(self, scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> None:
        """Plug in a KV connector (before the first request): its scheduler side, and the
        worker side of THIS process (the other ranks / stages build their own)."""
        assert not self.scheduler.has_work(), "set the connector before adding requests"
        self.connector = scheduler
        self.scheduler.connector = scheduler
        scheduler.bind_block_pool(self.pool)
        worker = guarded(worker)  # its calls fail requests, not the step
        self.kv_worker = worker
        if isinstance(self.runner, ConnectorExecutor):
            self.runner.set_kv_worker(worker)
        else:
            worker.register_kv_caches(self.runner.kv_caches, self.worker_place())

    def worker_place(self) -> WorkerPlace:
        """Where this process's worker side sits: every layer (one process)."""
        return WorkerPlace(0, self.info.config.num_layers)

    # -- the API -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
    ) -> RequestId:
        """Queue a request. Raises InvalidRequestError / PromptTooLongError (user errors).

        prefill_only: leave the engine right after the first sampled token (a prefill
        instance); the output says prefill_done unless the token already finished it."""
        req = self._new_request(prompt_token_ids, params, request_id)
        req.prefill_only = prefill_only
        self.scheduler.add(req)
        return req.request_id

    def _new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None
    ) -> Request:
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        self.validate(prompt_token_ids, params)
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(
            rid,
            prompt_token_ids,
            params,
            block_size=self.config.block_size,
            hash_root=self._hash_root,
            eos_token_ids=self.info.eos_token_ids,
        )
        if params.grammar is not None:
            req.grammar = self.grammars.new_state(params.grammar)
        self._requests[rid] = req
        self._texts[rid] = RequestOutputText(self.info.tokenizer, params, req.eos_token_ids)
        return req

    def append_remote_token(
        self,
        request_id: str,
        token_id: int,
        logprob: float | None,
        top_logprobs: TopLogprobs | None = None,
    ) -> RequestOutput | None:
        """Decode: append the first token, sampled by prefill, to a request whose prompt
        KV arrives through the KV connector (it waits in WAITING_FOR_KV until the load
        is reported, then computes this token's KV and samples the next). Returns the
        token's output (finished if it already ends the request; the caller does not
        stream it otherwise: prefill did); None if the request is unknown or has output."""
        req = self._requests.get(RequestId(request_id))
        if req is None or req.num_output_tokens or req.status.finished:
            return None
        return self._append_token(req, token_id, logprob, top_logprobs)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a request against this engine's limits without queueing it."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: at least one token is required")
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        vocab = self.info.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.check_fits(len(prompt_token_ids), params.max_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise PromptTooLongError unless prompt + max_tokens fits the context and cache."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{total} were requested ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion); shorten the prompt or max_tokens"
            )
        capacity = self.pool.num_blocks * self.config.block_size
        if total > capacity:
            raise PromptTooLongError(
                f"the request needs KV for {total} tokens but this instance's KV cache holds "
                f"{capacity}; shorten the prompt or max_tokens, or give the cache more memory"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV at once; False if it is unknown or finished."""
        req = self._requests.pop(RequestId(request_id), None)
        if req is None:
            return False
        self._texts.pop(req.request_id, None)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_all(self) -> int:
        """Abort every live request (after a failed step); returns how many."""
        ids = list(self._requests)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.connector.has_pending()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of requests that produced tokens (or
        failed alone: engine/step_isolation.py)."""
        trace = self.trace
        t0 = time.monotonic() if trace is not None else 0.0
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return self._poll_connector(plan)
        if self.step_threads is not None:
            self.step_threads.before_step(plan)
        t_sched = time.monotonic() if trace is not None else 0.0
        rows: list[Row] = (
            [
                (s.request.request_id, s.num_new_tokens, s.request.num_computed_tokens, s.samples)
                for s in plan.scheduled
            ]
            if trace is not None
            else []
        )
        logits, reports, culprits = self._execute(plan)
        t_exec = time.monotonic() if trace is not None else 0.0
        reports, failing = self.split_reports(reports)
        if failing:  # a connector call failed for them (engine/kv_connector_guard.py)
            kept = [  # the rows of `logits`
                s.request.request_id
                for s in plan.scheduled
                if s.samples and s.request.request_id not in culprits
            ]
            keep = [i for i, rid in enumerate(kept) if rid not in failing]
            if logits is not None and len(keep) != len(kept):
                logits = logits[keep] if keep else None
            culprits = {**failing, **culprits}
        scheduled = [s for s in plan.scheduled if s.request.request_id not in culprits]
        sampling = [s.request for s in scheduled if s.samples]
        tokens: list[int] = []
        logprobs: list[float | None] = []
        tops: list[TopLogprobs | None] = []
        failed_rows: dict[int, str] = {}
        if logits is not None:
            states = [
                SamplingState(
                    r.params,
                    r.num_output_tokens,
                    r.generator,
                    r.eos_token_ids,
                    r.prompt_token_ids,
                    r.output_token_ids,
                    r.grammar,
                )
                for r in sampling
            ]
            result, failed_rows = sample_isolating(
                self.sampler,
                logits,
                states,
                self.config.faults,
                before_wait=self._decode_ahead(plan, scheduled, culprits),
            )
            tokens, logprobs = result.token_ids, result.logprobs
            tops = result.top_logprobs or [None] * len(tokens)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)
        self.apply_reports(reports)
        outputs = [self.fail_request(self._requests[rid], err) for rid, err in culprits.items()]
        for i, (req, tok, lp, top) in enumerate(zip(sampling, tokens, logprobs, tops, strict=True)):
            if i in failed_rows:
                outputs.append(self.fail_request(req, f"sampling failed: {failed_rows[i]}"))
            else:
                outputs.append(self.append_isolating(req, tok, lp, top))
        if trace is not None:
            trace.step(t0, t_sched, t_exec, rows)
        return outputs

    def _decode_ahead(
        self,
        plan: SchedulerOutput,
        scheduled: list[ScheduledRequest],
        culprits: dict[RequestId, str],
    ) -> Callable[[torch.Tensor], None] | None:
        """The sampler's hook that launches the next decode step while this step's tokens
        travel to the host (engine/decode_ahead.py), or None when that step would likely
        be dropped or cannot run ahead: this step is not pure decode, something else
        could join the next step (waiting or loading requests, connector work), or every
        request ends at this token by length."""
        runner = self.runner
        sched = self.scheduler
        if (
            not self.config.decode_ahead
            or not isinstance(runner, ModelRunner)
            or runner.graphs is None
            or culprits
            or plan.kv_meta
            or self.config.faults is not None
            or self.connector.saves_on_eviction()  # allocates only while scheduling
            or sched.waiting
            or sched.loading
            or len(scheduled) != len(sched.running)
            or any(s.num_new_tokens != 1 or not s.samples for s in scheduled)
            or all(
                s.request.num_output_tokens + 1 >= s.request.params.max_tokens for s in scheduled
            )
        ):
            return None
        kv, bs = self.kv, self.config.block_size

        def launch(tokens: torch.Tensor) -> None:
            try:
                for s in scheduled:  # the KV block of the next position, one step early
                    r = s.request
                    short = (r.num_computed_tokens + 1) // bs >= len(kv.block_table(r.request_id))
                    if short and not kv.allocate_slots(r, 2):
                        return
                runner.launch_ahead(scheduled, kv, tokens)
            except Exception:  # the step itself is done: only the head start is lost
                log.exception("launching the next decode step early failed")
                runner.drop_ahead()

        return launch

    def _execute(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, list[bytes], dict[RequestId, str]]:
        """The execute part of a step: the model and the connector's workers; (logits of
        the sampling rows of the requests that did not fail, the workers' reports, the
        requests whose forward failed with why)."""
        if isinstance(self.runner, ConnectorExecutor):
            return self._execute_ranks(self.runner, plan)
        worker = self.kv_worker
        worker.start_loads(plan.kv_meta)
        meta, culprits = plan.kv_meta, {}
        try:
            logits = self._forward(plan.scheduled)
        except Exception as e:
            found = find_culprits(plan.scheduled, self._forward, e)
            culprits = {
                plan.scheduled[i].request.request_id: f"forward failed: {err}"
                for i, err in found.items()
            }
            rest = [s for i, s in enumerate(plan.scheduled) if i not in found]
            logits = self._forward(rest) if rest else None
            meta = self.connector.without_requests(plan.kv_meta, set(culprits))
        worker.start_saves(meta)
        return logits, [worker.get_finished()], culprits

    def _execute_ranks(
        self, runner: ConnectorExecutor, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, list[bytes], dict[RequestId, str]]:
        """_execute over a TP x DCP instance: its ranks re-run the bisection in lockstep."""
        try:
            logits, reports = runner.execute_step(plan.scheduled, self.kv, plan.kv_meta)
            return logits, reports, {}
        except ForwardFailed as e:

            def probe(sub: Sequence[ScheduledRequest]) -> object:
                return runner.execute_step(list(sub), self.kv, b"", load=False, probe=True)

            found = find_culprits(plan.scheduled, probe, e)
        culprits = {
            plan.scheduled[i].request.request_id: f"forward failed: {err}"
            for i, err in found.items()
        }
        rest = [s for i, s in enumerate(plan.scheduled) if i not in found]
        meta = self.connector.without_requests(plan.kv_meta, set(culprits))
        logits, reports = runner.execute_step(rest, self.kv, meta, load=False)
        return logits, reports, culprits

    def _forward(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        """This process's model over `scheduled` (safe to repeat: the same KV slots are
        written with the same values)."""
        if self.config.faults is not None:
            self.config.faults.check("forward", (s.request.params for s in scheduled))
        return self.runner.execute(list(scheduled), self.kv)

    def fail_request(self, req: Request, error: str) -> RequestOutput:
        """End `req` alone with `error` (its step failed because of it) and free its KV
        (a forward culprit's blocks of the step were never cached: their KV is invalid)."""
        log.warning("request %s failed alone: %s", req.request_id, error)
        self._requests.pop(req.request_id, None)
        self._texts.pop(req.request_id, None)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_logprobs=[],
            text_delta="",
            finish_reason="error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens or 0,
            num_output_tokens=req.num_output_tokens,
            num_pool_tokens=req.num_pool_prompt_tokens,
            error=error,
        )

    def append_isolating(
        self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None = None
    ) -> RequestOutput:
        """_append_token, failing only `req` if its detokenization or stop checks raise."""
        try:
            return self._append_token(req, token, logprob, top)
        except Exception as e:
            return self.fail_request(req, f"detokenization failed: {describe(e)}")

    def _poll_connector(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Nothing to compute: deliver the step's connector metadata (a load to start) or,
        while transfers are outstanding, wait a little and collect the workers' reports.
        Returns the requests a failed connector call ended."""
        if not plan.kv_meta:
            if not self.connector.has_pending():
                return []
            self.kv_worker.wait(LOAD_POLL_S)
        if isinstance(self.runner, ConnectorExecutor):
            reports = self.runner.poll_kv(plan.kv_meta)
        else:
            self.kv_worker.start_loads(plan.kv_meta)
            self.kv_worker.start_saves(plan.kv_meta)
            reports = [self.kv_worker.get_finished()]
        reports, failing = self.split_reports(reports)
        self.apply_reports(reports)
        return [
            self.fail_request(self._requests[rid], why)
            for rid, why in failing.items()
            if rid in self._requests
        ]

    def apply_reports(self, reports: list[bytes]) -> None:
        """The workers' connector reports of a step (one per process, after
        split_reports) into the scheduler."""
        self.scheduler.update_from_connector(self.connector.update_from_workers(reports))

    def split_reports(self, reports: list[bytes]) -> tuple[list[bytes], dict[RequestId, str]]:
        """The workers' own reports, and the live requests that connector calls which
        failed in some process end (engine/kv_connector_guard.py), with why. The
        connector's scheduler side learns of the failures here, before the reports are
        applied. A connector that cannot say which requests a failure concerns fails
        the step (RuntimeError)."""
        inner, failures = split_failures(reports)
        failing: dict[RequestId, str] = {}
        for f in failures:
            why = f"the KV connector's {f.call} failed in process {f.process}: {f.error}"
            try:
                named = self.connector.workers_failed(f.meta, why, f.process)
            except NotImplementedError as e:
                raise RuntimeError(f"{why} ({e})") from None
            for rid in named:
                if rid in self._requests:
                    failing.setdefault(rid, why)
        return inner, failing

    def _append_token(
        self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None = None
    ) -> RequestOutput:
        req.append_output(token, logprob)
        delta, reason = self._texts[req.request_id].append(token)
        prefill_done = reason is None and req.prefill_only
        if reason is not None or prefill_done:
            status = (
                RequestStatus.FINISHED_LENGTH
                if reason == "length"
                else RequestStatus.FINISHED_STOPPED
            )
            self.scheduler.finish(req, status)
            del self._requests[req.request_id]
            del self._texts[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_logprobs=[logprob],
            text_delta=delta,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens or 0,
            num_output_tokens=req.num_output_tokens,
            num_pool_tokens=req.num_pool_prompt_tokens,
            prefill_done=prefill_done,
            new_top_logprobs=[top] if top is not None else None,
        )

    # -- helpers -----------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion in one continuous batch; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        acc: dict[RequestId, Completion] = {
            rid: Completion(rid, [], "", "", [], len(p), 0)
            for rid, p in zip(ids, prompts, strict=True)
        }
        pending = set(ids)
        while pending:
            for out in self.step():
                c = acc.get(out.request_id)
                if c is None:
                    continue
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.new_logprobs)
                c.text += out.text_delta
                c.num_cached_tokens = out.num_cached_tokens
                c.num_pool_tokens = out.num_pool_tokens
                if out.finished:
                    c.finish_reason = out.finish_reason or ""
                    pending.discard(out.request_id)
        return [acc[r] for r in ids]

    def stream(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they are produced (drives the whole engine)."""
        rid = self.add_request(prompt_token_ids, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def reset_prefix_cache(self) -> int:
        """Forget the GPU prefix cache (an external store behind the connector keeps its
        contents). Returns how many block hashes were dropped."""
        return self.pool.reset_prefix_cache()

    def close(self) -> None:
        """Stop the KV connector's threads and the runner's processes (the engine itself
        holds no threads)."""
        self.connector.close()
        self.kv_worker.close()
        self.runner.close()
        self.grammars.close()

    @property
    def counters(self) -> SchedulerCounters:
        return self.scheduler.counters

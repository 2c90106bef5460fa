"""LLMEngine: the small API both workers drive (add_request / step / abort).

step():  schedule   scheduler.schedule(): the batch and the KV connector's step metadata
         execute    the connector's workers start loads, the model runs (here, or on the
                    ranks / stages of a parallel instance), the workers start saves and
                    report what finished
         update     progress advances, full blocks are cached, the workers' reports go to
                    the connector (loads done, blocks released), sampled tokens are
                    appended, finished requests leave -> RequestOutput per request

KV moves in and out only through the KV connector (engine/kv_connector.py), set with
`set_kv_connector`; with none the engine runs the "off" connector. The execute part is
engine/step_execution.py (`StepExecution`, this class's base); the model of a
one-process engine is built by engine/local_runner.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from itertools import count

import torch

from engine.admission import make_admission
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
from engine.kv_identity import kv_namespace, torch_dtype
from engine.local_runner import local_runner
from engine.model_runner import ModelExecutor
from engine.outputs import Completion, RequestOutput
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, SamplingState, TopLogprobs
from engine.scheduler import Scheduler, SchedulerCounters
from engine.step_execution import ConnectorExecutor, StepExecution
from engine.step_isolation import describe, sample_isolating
from engine.step_threads import StepThreads
from engine.step_trace import Row, StepTrace
from modelinfo.detokenizer import RequestOutputText
from modelinfo.info import ModelInfo, load_model_info
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.hashing import namespace_seed
from protocol.ids import RequestId
from protocol.kv_layout import KVLayout
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine(StepExecution):
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
        self.runner: ModelExecutor = (
            runner
            if runner is not None
            else local_runner(
                info,
                config,
                self.layout,
                device=self.device,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
            )
        )
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
            admission=make_admission(config.admission),
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
        cpu0 = time.thread_time() if trace is not None else 0.0
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
        past_prompt = (
            sum(
                s.request.num_computed_tokens >= s.request.num_prompt_tokens for s in plan.scheduled
            )
            if trace is not None
            else 0
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
            sched = self.scheduler
            trace.step(
                t0,
                cpu0,
                t_sched,
                t_exec,
                rows,
                pre=len(plan.preempted),
                queued=len(sched.waiting) + len(sched.loading),
                past_prompt=past_prompt,
            )
        return outputs

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

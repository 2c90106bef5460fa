"""The prefill instance's HTTP service: POST /prefill streams FirstToken.

/prefill ─▶ landing capabilities verified (403 and nothing written otherwise) ─▶
handoff target registered (landing ring, decode's notify URL) ─▶
engine.add_request(prefill_only) ─▶ steps: every stage sends each step's new KV from its
own threads (prefill_worker/handoff.py) and tells decode directly ─▶ first token sampled
─▶ FirstToken to the router, PrefillFirstToken to decode (off the engine thread). The
router hears of a failed transfer from decode, whose stream it reads next.

A request sent beside decode's (await_landing: no landing yet) computes at once and keeps
its KV; POST /landing brings decode's landing (LandingGrant, checked as an inline one;
it may come before the request, and is kept then). The first step after it opens the
flow on every stage and sends all that is computed. FirstToken goes to the router at
once; PrefillFirstToken to decode once the grant is in. Without a grant within
`landing_wait_s` of its arrival the KV is freed (a later grant: 410).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_trace import StepTrace, milestones
from enginehost.app import base_app, error_response, read_message
from enginehost.host import EngineHost
from enginehost.kv_events import KVReporter
from prefill_worker.handoff import GrantOutcome, HandoffScheduler
from prefill_worker.heap_trim import HeapTrimmer
from prefill_worker.metrics import PrefillMetrics
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.handoff_messages import FlowResult
from protocol.internal_auth import auth_headers
from protocol.landing_capability import LandingCapabilityError, capability_key, verify
from protocol.messages import (
    AbortRequest,
    ErrorEvent,
    FirstToken,
    InstanceStatus,
    LandingGrant,
    LandingInfo,
    PrefillFirstToken,
    PrefillRequest,
    PromptUsage,
    encode_line,
)
from transfer.faults import HandoffFaults

log = logging.getLogger(__name__)

ABORTED_KEPT = 4096
"""Aborted request ids remembered (an abort may reach prefill before its request)."""


def usage_of(out: RequestOutput) -> PromptUsage:
    """Every prompt token once: from the GPU prefix cache, the pool, or computed."""
    gpu, pool = out.num_cached_tokens, out.num_pool_tokens
    return PromptUsage(
        prompt_tokens=out.num_prompt_tokens,
        gpu_tokens=gpu,
        pool_tokens=pool,
        computed_tokens=out.num_prompt_tokens - gpu - pool,
    )


@dataclass
class _Awaiting:
    """A request sent with await_landing, until its grant is in (or it ends)."""

    arrival: float
    granted: asyncio.Future[str]
    """Decode's notify URL, once a grant was applied."""


class PrefillService:
    """Owns the HTTP routes of a prefill instance over its engine host and handoffs."""

    def __init__(
        self,
        name: str,
        host: EngineHost,
        handoffs: HandoffScheduler,
        secret: str,
        num_devices: int = 1,
        faults: HandoffFaults | None = None,
        trace: StepTrace | None = None,
        landing_wait_s: float = 60.0,
    ) -> None:
        self.name = name
        self.landing_wait_s = landing_wait_s
        """How long an await_landing request keeps its KV for its grant (from arrival)."""
        self._awaiting: dict[str, _Awaiting] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        """Requests' waits for their grants (after their FirstToken went out)."""
        self.milestone = milestones(trace)
        """Records a request's milestone beside the engine's steps (engine/step_trace.py)."""
        self.faults = faults or HandoffFaults()
        """Test-only injected faults (cluster.yaml handoff_faults): the door's hold."""
        self.secret = secret
        """The cluster secret: its routes need it, its notices to decode carry it."""
        self.capability_key = capability_key(secret)
        self.host = host
        self.handoffs = handoffs
        self.metrics = PrefillMetrics(name, host, num_devices)
        self.registry = self.metrics.registry
        handoffs.on_closed = self._handoff_closed
        self.kv_reporter = KVReporter(name, "prefill", host, record_block_events=True)
        """GET /info and /kv_events for KV-aware routing; the pool connector reports its
        saves and restores to it (record_pool_saved, record_restore)."""
        self._http = httpx.AsyncClient(timeout=10.0, trust_env=False, headers=auth_headers(secret))
        self.heap_trimmer = HeapTrimmer()
        """Gives the heap's free pages back after large batches (prefill_worker/heap_trim.py);
        started and stopped with the app."""
        self._aborted: OrderedDict[str, None] = OrderedDict()
        """Ids of the last ABORTED_KEPT aborts: a request aborted before it entered the
        engine (held at the door, or overtaken by its abort) is refused, not computed."""

    def status(self) -> InstanceStatus:
        """Engine thread."""
        e = self.host.engine
        load = self.kv_reporter.load(e)
        return InstanceStatus(
            name=self.name,
            role="prefill",
            healthy=True,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
            queued_tokens=load.queued_tokens,
            compute_tokens_per_s=load.compute_tokens_per_s,
            restore_bytes_per_s=load.restore_bytes_per_s,
        )

    def app(self) -> FastAPI:
        app = base_app(self.host, self.status, self.registry, self.secret, on_abort=self.on_abort)
        self.kv_reporter.install(app)
        app.post("/prefill")(self.prefill)
        app.post("/landing")(self.landing)
        app.post("/admin/reset_prefix_cache")(self.reset_prefix_cache)
        return app

    def on_abort(self, msg: AbortRequest) -> None:
        """The request may have left the engine with its KV still on the way: stop that."""
        rid = msg.request_id
        self._aborted[rid] = None
        while len(self._aborted) > ABORTED_KEPT:
            self._aborted.popitem(last=False)
        self.host.loop.submit(lambda _e: self.handoffs.cancel(rid))
        waiting = self._awaiting.pop(rid, None)
        if waiting is not None and not waiting.granted.done():
            waiting.granted.cancel()

    async def reset_prefix_cache(self) -> Response:
        n = await self.host.call(lambda e: e.reset_prefix_cache())
        return Response(msgspec.json.encode({"dropped_blocks": n}), media_type="application/json")

    async def prefill(self, request: Request) -> Response:
        msg = await read_message(request, PrefillRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, PrefillRequest)
        rid = msg.request_id
        arrival = time.monotonic()
        self.milestone("arrival", rid)
        wants_handoff = bool(msg.landing)
        awaits = msg.await_landing
        if awaits and (wants_handoff or msg.notify_url):
            return error_response(
                400,
                "a PrefillRequest with await_landing carries no landing or notify_url: "
                "they come in its LandingGrant (POST /landing)",
                rid,
            )
        if wants_handoff and not msg.notify_url:
            return error_response(400, "a PrefillRequest with landing needs notify_url", rid)
        if awaits and rid in self._awaiting:
            return error_response(409, f"request {rid} is in this instance already", rid)
        refused = self._check_landing(rid, msg.landing)
        if refused is not None:
            self.metrics.outcome("rejected")
            return error_response(403, refused, rid)
        waiting = None
        if awaits:  # before any await: a grant coming meanwhile finds the request
            waiting = _Awaiting(arrival, asyncio.get_running_loop().create_future())
            self._awaiting[rid] = waiting
        try:
            added = await self._add(msg, wants_handoff)
        except BaseException:
            self._forget(rid, waiting)
            raise
        if isinstance(added, Response):
            self._forget(rid, waiting)
            return added
        queue, early = added
        if waiting is not None and early is not None:
            self._granted(rid, waiting, early)
        self.milestone("added", rid)
        return StreamingResponse(
            self._events(rid, queue, msg.notify_url if wants_handoff else None, arrival, waiting),
            media_type="application/x-ndjson",
        )

    async def _add(
        self, msg: PrefillRequest, wants_handoff: bool
    ) -> Response | tuple[object, str | None]:
        """Into the engine: (its output queue, the notify URL of a grant that came before
        the request), or the error answer."""
        rid = msg.request_id
        await self.faults.hold(len(msg.prompt_token_ids))
        if rid in self._aborted:
            self.metrics.outcome("aborted")
            return error_response(409, f"request {rid} was aborted before it started", rid)
        queue = self.host.open_stream(rid)

        def add(e: LLMEngine) -> str | None:
            early = None
            if wants_handoff:
                self.handoffs.add(rid, msg.landing, len(msg.prompt_token_ids), msg.notify_url)
            elif msg.await_landing:
                early = self.handoffs.await_landing(rid, len(msg.prompt_token_ids))
            try:
                e.add_request(msg.prompt_token_ids, msg.params, rid, prefill_only=True)
            except BaseException:
                self.handoffs.discard(rid)
                raise
            return early

        try:
            early = await self.host.call(add)
        except (InvalidRequestError, PromptTooLongError) as e:
            self.host.close_stream(rid)
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        return queue, early

    def _forget(self, rid: str, waiting: _Awaiting | None) -> None:
        if waiting is None:
            return
        if self._awaiting.get(rid) is waiting:
            del self._awaiting[rid]
        if not waiting.granted.done():
            waiting.granted.cancel()

    def _granted(self, rid: str, waiting: _Awaiting, notify_url: str) -> None:
        if not waiting.granted.done():
            waiting.granted.set_result(notify_url)
            self.metrics.landing_waited(time.monotonic() - waiting.arrival)

    async def landing(self, request: Request) -> Response:
        """POST /landing: decode's landing for a request sent with await_landing."""
        msg = await read_message(request, LandingGrant)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, LandingGrant)
        rid = msg.request_id
        if not msg.landing or not msg.notify_url:
            return error_response(400, "a LandingGrant needs a landing and a notify_url", rid)
        if rid in self._aborted:
            self.metrics.grant("gone")
            return error_response(410, f"request {rid} was aborted", rid)
        refused = self._check_landing(rid, msg.landing)
        if refused is not None:
            self.metrics.grant("refused")
            return error_response(403, refused, rid)
        outcome = await self.host.call(
            lambda _e: self.handoffs.grant(rid, msg.landing, msg.notify_url)
        )
        self.metrics.grant(outcome.value)
        if outcome is GrantOutcome.CONFLICT:
            return error_response(409, f"request {rid} has its landing already", rid)
        if outcome is GrantOutcome.GONE:
            return error_response(
                410,
                f"request {rid} has ended here (aborted, finished at its first token, or no "
                f"landing within landing_wait_s = {self.landing_wait_s:g} s)",
                rid,
            )
        waiting = self._awaiting.get(rid)
        if outcome is GrantOutcome.ACCEPTED and waiting is not None:
            self._granted(rid, waiting, msg.notify_url)
        self.milestone("granted", rid)
        body = msgspec.json.encode({"request_id": rid, "outcome": outcome.value})
        return Response(body, media_type="application/json")

    def _handoff_closed(self, request_id: str, stages: list[FlowResult]) -> None:
        """Engine thread: every stage closed its flow of the request."""
        self.milestone("handoff_done", request_id)
        self.metrics.handoff_closed(request_id, stages)

    def _check_landing(self, request_id: str, landing: list[LandingInfo]) -> str | None:
        """Why the request's landing may not be written (each rank's capability, minted
        by decode for this request id, unaltered and unexpired), or None. Every stage
        checks again before its first write (prefill_worker/handoff.py)."""
        now = time.time()
        ranks = [info.rank for info in landing]
        if len(set(ranks)) != len(ranks):
            return f"the landing names decode rank(s) more than once: {sorted(ranks)}"
        for info in landing:
            try:
                verify(self.capability_key, request_id, info, now)
            except LandingCapabilityError as e:
                log.warning("refused the landing of %s: %s", request_id, e)
                return f"landing refused: {e}"
        return None

    async def _events(  # type: ignore[no-untyped-def]
        self, rid: str, queue, notify_url: str | None, arrival: float, waiting: _Awaiting | None
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            out = await queue.get()
            if isinstance(out, BaseException) or out.error is not None:
                self._forget(rid, waiting)
                why = str(out) if isinstance(out, BaseException) else out.error
                message = f"request {rid} failed in prefill instance {self.name}: {why}"
                status = getattr(out, "status", 500)  # InstanceLost: 503
                yield encode_line(ErrorEvent(request_id=rid, status=status, message=message))
                finished = True
                self.metrics.outcome("failed")
                return
            usage = usage_of(out)
            self.metrics.first_token(usage, time.monotonic() - arrival)
            self.milestone("first_token", rid)
            yield encode_line(
                FirstToken(
                    request_id=rid,
                    token_id=out.new_token_ids[0],
                    logprob=out.new_logprobs[0],
                    usage=usage,
                    finish_reason=out.finish_reason,
                    top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else None,
                )
            )
            finished = True
            if waiting is not None:
                top = out.new_top_logprobs[0] if out.new_top_logprobs else None
                notice = PrefillFirstToken(rid, out.new_token_ids[0], out.new_logprobs[0], top)
                if out.finish_reason is not None:  # nothing for decode: free the KV
                    self._forget(rid, waiting)
                    self.metrics.outcome("finished")
                    await self.host.call(lambda _e: self.handoffs.cancel(rid))
                    return
                task = asyncio.create_task(self._after_grant(rid, waiting, notice))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
            if notify_url is None:
                self.metrics.outcome("finished")
                return
            if out.finish_reason is not None:
                self.metrics.outcome("finished")
                await self.host.call(lambda _e: self.handoffs.cancel(rid))
                return
            top = out.new_top_logprobs[0] if out.new_top_logprobs else None
            notice = PrefillFirstToken(rid, out.new_token_ids[0], out.new_logprobs[0], top)
            await self._tell_decode(notify_url, notice)
        finally:
            self.host.close_stream(rid)
            if not finished:  # the client (router) went away before the first token
                self._forget(rid, waiting)
                await self.host.call(lambda e: e.abort(rid))
                self.metrics.outcome("aborted")

    async def _after_grant(self, rid: str, waiting: _Awaiting, notice: PrefillFirstToken) -> None:
        """Tell decode the first token once the grant is in; without one within
        landing_wait_s of the request's arrival, free its KV (a later grant: 410)."""
        left = waiting.arrival + self.landing_wait_s - time.monotonic()
        try:
            try:
                notify_url = await asyncio.wait_for(asyncio.shield(waiting.granted), max(0, left))
            except TimeoutError:

                def expire(_e: LLMEngine) -> bool:
                    if not self.handoffs.awaiting(rid):
                        return False  # granted meanwhile (its future is about to be set)
                    self.handoffs.cancel(rid)
                    return True

                if await self.host.call(expire):
                    log.warning("no landing for %s within %g s: freed", rid, self.landing_wait_s)
                    self.metrics.outcome("landing_expired")
                    self._forget(rid, waiting)
                    return
                notify_url = await waiting.granted
        except asyncio.CancelledError:  # aborted: on_abort freed it
            return
        finally:
            if self._awaiting.get(rid) is waiting:
                del self._awaiting[rid]
        await self._tell_decode(notify_url, notice)

    async def _tell_decode(self, url: str, notice: PrefillFirstToken) -> None:
        """Decode continues after the first token; if it is gone, stop sending its KV."""
        try:
            resp = await self._http.post(url, content=msgspec.json.encode(notice))
            if resp.status_code == 200:
                return
            log.info("decode no longer holds %s (%d)", notice.request_id, resp.status_code)
        except httpx.HTTPError as e:
            log.warning("first token of %s could not reach decode: %s", notice.request_id, e)
        await self.host.call(lambda _e: self.handoffs.cancel(notice.request_id))

    async def aclose(self) -> None:
        await self._http.aclose()

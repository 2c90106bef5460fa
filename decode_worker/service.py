"""The decode instance's HTTP service.

    POST /decode     DecodeRequest -> NDJSON stream, opened BEFORE prefill runs:
                     landing region allocated (waits while the arena is full), request
                     added to the engine, which reserves its pages and keeps it in
                     WAITING_FOR_KV (decode_worker/receiver.py) -> DecodeReady (landing
                     with a capability per rank, protocol/landing_capability.py; notify
                     URL) -> TokenBatch ... once prefill's KV and first token are in
    POST /kv_notify  HandoffNotice from prefill's stages (SegmentsLanded: checked against
                     the region reserved for the request, 400 otherwise; answered after
                     the scatter: 200, or 410 when the request is gone), PrefillFirstToken,
                     FlowClosed

A landing region lives until no write into it can be in flight (receiver.py); one given
up whose prefill never closed its flows is freed after the landing quarantine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from decode_worker.metrics import DecodeMetrics
from decode_worker.ranks import RankLandings
from decode_worker.receiver import HandoffReceiver
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_trace import StepTrace, milestones
from enginehost.app import PROCESS_INCARNATION, base_app, error_response, read_message
from enginehost.host import EngineHost
from enginehost.kv_events import KVReporter
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.landing_capability import capability_key, mint
from protocol.messages import (
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    ErrorEvent,
    FlowClosed,
    HandoffNotice,
    InstanceStatus,
    PrefillFirstToken,
    SegmentsLanded,
    TokenBatch,
    encode_line,
)
from transfer import LandingArena

log = logging.getLogger(__name__)

_notice = msgspec.json.Decoder(HandoffNotice)  # type: ignore[var-annotated]


class DecodeService:
    """Owns the HTTP routes of a decode instance, its landing arena and admission."""

    def __init__(
        self,
        name: str,
        host: EngineHost,
        arena: LandingArena,
        *,
        ranks: RankLandings,
        receiver: HandoffReceiver,
        notify_url: str,
        admit_timeout_s: float,
        quarantine_s: float,
        secret: str,
        landing_ttl_s: float,
        num_devices: int = 1,
        trace: StepTrace | None = None,
    ) -> None:
        self.name = name
        self.milestone = milestones(trace)
        """Records a request's milestone beside the engine's steps (engine/step_trace.py)."""
        self.secret = secret
        """The cluster secret: every route but /health and /metrics needs it."""
        self.capability_key = capability_key(secret)
        self.landing_ttl_s = landing_ttl_s
        """How long prefill may start writing a landing after DecodeReady."""
        self.host = host
        self.arena = arena
        """Rank 0's landing arena: it allocates one offset for every rank's buffer."""
        self.ranks = ranks
        self.receiver = receiver
        self.notify_url = notify_url
        self.admit_timeout_s = admit_timeout_s
        self.quarantine_s = quarantine_s
        self.kv_reporter = KVReporter(name, "decode", host, record_block_events=False)
        """GET /info and /kv_events (load only) for decode choice and the admission gate."""
        self.metrics = DecodeMetrics(name, host, arena, num_devices)
        self.registry = self.metrics.registry
        receiver.on_flow_closed = self.metrics.flow_closed

    def status(self) -> InstanceStatus:
        """Engine thread."""
        e = self.host.engine
        return InstanceStatus(
            name=self.name,
            role="decode",
            healthy=True,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting) + len(e.scheduler.loading),
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
            landing_bytes_total=self.arena.total_bytes,
            landing_bytes_used=self.arena.used_bytes,
        )

    def app(self) -> FastAPI:
        app = base_app(self.host, self.status, self.registry, self.secret, on_abort=self.on_abort)
        self.kv_reporter.install(app)
        app.post("/decode")(self.decode)
        app.post("/kv_notify")(self.kv_notify)
        return app

    def on_abort(self, msg: AbortRequest) -> None:
        self.receiver.abort(msg.request_id, msg.prefill_contacted)

    async def reap_landing(self) -> None:
        """Free regions whose prefill never closed its flows (runs on the event loop)."""
        while True:
            await asyncio.sleep(min(1.0, self.quarantine_s))
            for rid in self.receiver.reap(self.quarantine_s):
                log.warning("landing region of %s freed after the quarantine", rid)

    # -- the request ------------------------------------------------------------------------
    async def decode(self, request: Request) -> Response:
        msg = await read_message(request, DecodeRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, DecodeRequest)
        rid = msg.request_id
        self.milestone("arrival", rid)
        try:
            await self.host.call(lambda e: e.validate(msg.prompt_token_ids, msg.params))
        except (InvalidRequestError, PromptTooLongError) as e:
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        if self.receiver.holds(rid) or self.host.has_stream(rid):
            self.metrics.outcome("rejected")
            return error_response(409, f"request id {rid!r} is already in use", rid)
        nbytes = self.ranks.region_bytes(len(msg.prompt_token_ids))
        waited_from = time.monotonic()
        region = await asyncio.to_thread(self.arena.allocate, rid, nbytes, self.admit_timeout_s)
        self.metrics.landing_wait.observe(time.monotonic() - waited_from)
        if region is None:
            self.metrics.outcome("no_landing")
            return error_response(
                503,
                f"decode instance {self.name} has no landing space free after "
                f"{self.admit_timeout_s:.0f}s; retry later",
                rid,
            )
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def resolve() -> None:
            if not ready.done():
                ready.set_result(None)

        def on_ready() -> None:  # engine thread: the pages are reserved
            loop.call_soon_threadsafe(resolve)

        self.receiver.expect(rid, region, len(msg.prompt_token_ids), on_ready)
        queue = self.host.open_stream(rid)
        try:
            await self.host.call(lambda e: e.add_request(msg.prompt_token_ids, msg.params, rid))
            self.milestone("added", rid)
            await asyncio.wait_for(asyncio.shield(ready), self.admit_timeout_s)
        except (InvalidRequestError, PromptTooLongError) as e:
            await self._give_up(rid)
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        except TimeoutError:
            await self._give_up(rid)
            self.metrics.outcome("no_kv")
            return error_response(
                503,
                f"decode instance {self.name} had no KV space for {rid} within "
                f"{self.admit_timeout_s:.0f}s; retry later",
                rid,
            )
        except BaseException:
            await self._give_up(rid)
            raise
        expires = time.time() + self.landing_ttl_s
        landing = [
            mint(self.capability_key, rid, info, expires)
            for info in self.ranks.landing_infos(region)
        ]
        ready_line = DecodeReady(rid, landing, self.notify_url, PROCESS_INCARNATION)
        return StreamingResponse(
            self._events(rid, queue, encode_line(ready_line)), media_type="application/x-ndjson"
        )

    async def _give_up(self, rid: str) -> None:
        """Nothing was sent to prefill yet: free the engine request and the region now."""
        self.host.close_stream(rid)
        await asyncio.shield(self.host.call(lambda e: e.abort(rid)))
        self.receiver.abort(rid, prefill_contacted=False)

    async def _events(self, rid: str, queue, ready_line: bytes) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        finished = False
        first_sent = False
        try:
            yield ready_line
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                failure = next(
                    (
                        str(i) if isinstance(i, BaseException) else i.error
                        for i in items
                        if isinstance(i, BaseException) or i.error is not None
                    ),
                    None,
                )
                if failure is not None:
                    finished = True
                    self.metrics.outcome("failed")
                    message = f"request {rid} failed in decode instance {self.name}: {failure}"
                    # InstanceLost (a rank died): 503
                    status = max(getattr(i, "status", 500) for i in items)
                    yield encode_line(ErrorEvent(request_id=rid, status=status, message=message))
                    return
                outs = [i for i in items if isinstance(i, RequestOutput)]
                tokens = [t for o in outs for t in o.new_token_ids]
                logprobs = [lp for o in outs for lp in o.new_logprobs]
                tops = None
                if any(o.new_top_logprobs for o in outs):
                    tops = [
                        t
                        for o in outs
                        for t in (o.new_top_logprobs or [None] * len(o.new_token_ids))
                    ]
                finished = outs[-1].finished
                if not first_sent and tokens:
                    first_sent = True
                    self.milestone("first_token", rid)
                self.metrics.generated_tokens.inc(len(tokens))
                if finished:
                    self.metrics.outcome("finished")
                yield encode_line(
                    TokenBatch(
                        rid,
                        tokens,
                        logprobs,
                        outs[-1].finish_reason,
                        outs[-1].num_output_tokens,
                        top_logprobs=tops,
                    )
                )
        finally:
            self.host.close_stream(rid)
            if not finished:  # the router went away: free the KV now (landing: fenced)
                self.metrics.outcome("aborted")
                await self.host.call(lambda e: e.abort(rid))

    # -- prefill's notices ----------------------------------------------------------------------
    async def kv_notify(self, request: Request) -> Response:
        try:
            notice = _notice.decode(await request.body())
        except msgspec.DecodeError as e:
            return error_response(400, f"invalid HandoffNotice: {e}")
        rid = notice.request_id
        if isinstance(notice, SegmentsLanded):
            problem = self.receiver.landing_problem(notice)
            if problem is not None:
                log.warning("refused a landed piece of %s: %s", rid, problem)
                return error_response(400, f"landed piece refused: {problem}", rid)
            ok = await asyncio.wrap_future(self.receiver.landed(notice))
        elif isinstance(notice, FlowClosed):
            self.receiver.closed(notice)
            ok = True
        else:
            ok = await self.host.call(lambda e: self._first_token(e, notice))
        if not ok:
            return error_response(410, f"decode no longer holds request {rid}", rid)
        return Response(b"{}", media_type="application/json")

    def _first_token(self, e: LLMEngine, notice: PrefillFirstToken) -> bool:
        """Engine thread: continue the waiting request after prefill's first token."""
        if not self.receiver.holds(notice.request_id):
            return False
        out = e.append_remote_token(
            notice.request_id, notice.token_id, notice.logprob, notice.top_logprobs
        )
        if out is None:
            return False
        self.receiver.first_token(notice.request_id)
        self.milestone("prefill_token", notice.request_id)
        if out.finished:  # the token ended it here (it did not at prefill): report it
            self.host.deliver(out)
        return True

"""The prefill instance's HTTP service: POST /prefill streams FirstToken, then HandoffDone.

/prefill ─▶ engine.add_request(prefill_only) ─▶ steps (KV observer streams the handoff
per chunk into decode's landing region) ─▶ first token sampled ─▶ FirstToken
─▶ HandoffDone (segments, bytes, ops) | ErrorEvent (the handoff failed)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.llm_engine import LLMEngine, RequestOutput
from enginehost.app import base_app, error_response, read_message
from enginehost.host import EngineHost
from enginehost.kv_events import KVReporter
from prefill_worker.handoff import HandoffTable
from prefill_worker.metrics import PrefillMetrics
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.messages import (
    ErrorEvent,
    FirstToken,
    InstanceStatus,
    PrefillRequest,
    PromptUsage,
    encode_line,
)

log = logging.getLogger(__name__)


def usage_of(out: RequestOutput) -> PromptUsage:
    """Every prompt token once: from the GPU prefix cache, the pool, or computed."""
    gpu, pool = out.num_cached_tokens, out.num_pool_tokens
    return PromptUsage(
        prompt_tokens=out.num_prompt_tokens,
        gpu_tokens=gpu,
        pool_tokens=pool,
        computed_tokens=out.num_prompt_tokens - gpu - pool,
    )


class PrefillService:
    """Owns the HTTP routes of a prefill instance over its engine host and handoff table."""

    def __init__(
        self, name: str, host: EngineHost, handoffs: HandoffTable, num_devices: int = 1
    ) -> None:
        self.name = name
        self.host = host
        self.handoffs = handoffs
        self.metrics = PrefillMetrics(name, host, num_devices)
        self.registry = self.metrics.registry
        host.engine.kv_observer = handoffs.observe
        self.kv_reporter = KVReporter(name, "prefill", host, record_block_events=True)
        """GET /info and /kv_events for KV-aware routing; the pool connector reports its
        saves and restores to it (record_pool_saved, record_restore)."""

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
        app = base_app(self.host, self.status, self.registry)
        self.kv_reporter.install(app)
        app.post("/prefill")(self.prefill)
        app.post("/admin/reset_prefix_cache")(self.reset_prefix_cache)
        return app

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
        queue = self.host.open_stream(rid)

        def add(e: LLMEngine) -> None:
            if msg.landing:
                self.handoffs.add(rid, msg.landing, len(msg.prompt_token_ids))
            try:
                e.add_request(msg.prompt_token_ids, msg.params, rid, prefill_only=True)
            except BaseException:
                self.handoffs.pop(rid)
                raise

        try:
            await self.host.call(add)
        except (InvalidRequestError, PromptTooLongError) as e:
            self.host.close_stream(rid)
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        return StreamingResponse(
            self._events(rid, queue, bool(msg.landing), arrival),
            media_type="application/x-ndjson",
        )

    async def _events(  # type: ignore[no-untyped-def]
        self, rid: str, queue, wants_handoff: bool, arrival: float
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            out = await queue.get()
            if isinstance(out, BaseException):
                yield encode_line(ErrorEvent(request_id=rid, status=500, message=str(out)))
                finished = True
                self.metrics.outcome("failed")
                return
            handoff = await self.host.call(lambda _e: self.handoffs.pop(rid))
            usage = usage_of(out)
            self.metrics.first_token(usage, time.monotonic() - arrival)
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
            if out.finish_reason is not None or not wants_handoff:
                self.metrics.outcome("finished")
                return
            if handoff is None or handoff.error is not None:
                message = handoff.error if handoff else "no handoff state"
                self.metrics.outcome("handoff_failed")
                yield encode_line(ErrorEvent(request_id=rid, status=502, message=message or ""))
                return
            self.metrics.handoff_done(handoff)
            yield encode_line(handoff.done_event(rid))
        finally:
            self.host.close_stream(rid)
            if not finished:  # the client (router) went away before the first token
                await self.host.call(lambda e: (e.abort(rid), self.handoffs.pop(rid)))
                self.metrics.outcome("aborted")

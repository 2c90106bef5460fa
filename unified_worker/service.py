"""The unified instance's HTTP service: POST /generate streams the whole request.

/generate ─▶ engine.add_request (no prefill_only: the request stays in the engine) ─▶
steps: the pool connector restores the history it holds (whole chunks, the request waits
in WAITING_FOR_KV while others run) and saves every new full chunk, prefill chunks and
other requests' decodes share each step ─▶ FirstToken (usage: gpu / pool / computed) ─▶
TokenBatch ... (tokens of one or more steps, as they come) until a finish_reason.

A client (router) that goes away mid-stream aborts the request in the engine: its KV is
freed at once (the pool's saves already queued go on, they are whole chunks). An
ErrorEvent replaces the stream's next line when the request failed in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_trace import StepTrace, milestones
from enginehost.app import base_app, error_response, read_message
from enginehost.host import EngineHost
from enginehost.kv_events import KVReporter
from prefill_worker.service import usage_of
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.messages import (
    ErrorEvent,
    FirstToken,
    GenerateRequest,
    InstanceStatus,
    TokenBatch,
    encode_line,
)
from unified_worker.metrics import ROLE, UnifiedMetrics

log = logging.getLogger(__name__)

Item = RequestOutput | BaseException


class UnifiedService:
    """Owns the HTTP routes of a unified instance over its engine host."""

    def __init__(
        self,
        name: str,
        host: EngineHost,
        secret: str,
        num_devices: int = 1,
        trace: StepTrace | None = None,
    ) -> None:
        self.name = name
        self.milestone = milestones(trace)
        """Records a request's milestone beside the engine's steps (engine/step_trace.py)."""
        self.secret = secret
        """The cluster secret: every route but /health and /metrics needs it."""
        self.host = host
        self.metrics = UnifiedMetrics(name, host, num_devices)
        self.registry = self.metrics.registry
        self.kv_reporter = KVReporter(name, ROLE, host, record_block_events=True)
        """GET /info and /kv_events for KV-aware routing (prefix-cache events, pool saves,
        load); the pool connector reports its saves and restores to it."""

    def status(self) -> InstanceStatus:
        """Engine thread."""
        e = self.host.engine
        load = self.kv_reporter.load(e)
        return InstanceStatus(
            name=self.name,
            role=ROLE,
            healthy=True,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting) + len(e.scheduler.loading),
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
            queued_tokens=load.queued_tokens,
            compute_tokens_per_s=load.compute_tokens_per_s,
            restore_bytes_per_s=load.restore_bytes_per_s,
        )

    def app(self) -> FastAPI:
        app = base_app(self.host, self.status, self.registry, self.secret)
        self.kv_reporter.install(app)
        app.post("/generate")(self.generate)
        app.post("/admin/reset_prefix_cache")(self.reset_prefix_cache)
        return app

    async def reset_prefix_cache(self) -> Response:
        n = await self.host.call(lambda e: e.reset_prefix_cache())
        return Response(msgspec.json.encode({"dropped_blocks": n}), media_type="application/json")

    async def generate(self, request: Request) -> Response:
        msg = await read_message(request, GenerateRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, GenerateRequest)
        rid = msg.request_id
        arrival = time.monotonic()
        self.milestone("arrival", rid)
        queue = self.host.open_stream(rid)

        def add(e: LLMEngine) -> None:
            e.add_request(msg.prompt_token_ids, msg.params, rid)

        try:
            await self.host.call(add)
            self.milestone("added", rid)
        except (InvalidRequestError, PromptTooLongError) as e:
            self.host.close_stream(rid)
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        except BaseException:
            self.host.close_stream(rid)
            await asyncio.shield(self.host.call(lambda e: e.abort(rid)))
            raise
        return StreamingResponse(
            self._events(rid, queue, arrival), media_type="application/x-ndjson"
        )

    async def _events(
        self, rid: str, queue: asyncio.Queue[Item], arrival: float
    ) -> AsyncIterator[bytes]:
        finished = False
        first_sent = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                failure = next((_failure(i) for i in items if _failure(i) is not None), None)
                if failure is not None:
                    finished = True
                    self.metrics.outcome("failed")
                    message = f"request {rid} failed in unified instance {self.name}: {failure}"
                    yield encode_line(ErrorEvent(request_id=rid, status=500, message=message))
                    return
                outs = [i for i in items if isinstance(i, RequestOutput)]
                if not first_sent and outs[0].new_token_ids:
                    first, outs = outs[0], outs[1:]
                    first_sent = True
                    finished = first.finished and not outs
                    yield self._first_token(first, arrival)
                if outs:
                    finished = outs[-1].finished
                    yield self._batch(rid, outs)
                if finished:
                    self.metrics.outcome("finished")
        finally:
            self.host.close_stream(rid)
            if not finished:  # the router went away: free the KV now
                self.metrics.outcome("aborted")
                await asyncio.shield(self.host.call(lambda e: e.abort(rid)))

    def _first_token(self, out: RequestOutput, arrival: float) -> bytes:
        usage = usage_of(out)
        self.metrics.first_token(usage, time.monotonic() - arrival)
        self.milestone("first_token", out.request_id)
        self.metrics.generated_tokens.inc()
        return encode_line(
            FirstToken(
                request_id=out.request_id,
                token_id=out.new_token_ids[0],
                logprob=out.new_logprobs[0],
                usage=usage,
                finish_reason=out.finish_reason,
                top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else None,
            )
        )

    def _batch(self, rid: str, outs: list[RequestOutput]) -> bytes:
        tokens = [t for o in outs for t in o.new_token_ids]
        logprobs = [lp for o in outs for lp in o.new_logprobs]
        tops = None
        if any(o.new_top_logprobs for o in outs):
            tops = [t for o in outs for t in (o.new_top_logprobs or [None] * len(o.new_token_ids))]
        self.metrics.generated_tokens.inc(len(tokens))
        return encode_line(
            TokenBatch(
                rid,
                tokens,
                logprobs,
                outs[-1].finish_reason,
                outs[-1].num_output_tokens,
                top_logprobs=tops,
            )
        )


def _failure(item: Item) -> str | None:
    if isinstance(item, BaseException):
        return str(item)
    return item.error

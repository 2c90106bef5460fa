"""The prefill instance's HTTP service: POST /prefill streams FirstToken, then HandoffDone.

/prefill ─▶ engine.add_request(prefill_only) ─▶ steps (KV observer streams the handoff
per chunk into decode's landing region) ─▶ first token sampled ─▶ FirstToken
─▶ HandoffDone (segments, bytes, ops) | ErrorEvent (the handoff failed)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.llm_engine import LLMEngine, RequestOutput
from enginehost.app import base_app, error_response, read_message
from enginehost.host import EngineHost
from prefill_worker.handoff import HandoffTable
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


class PrefillMetrics:
    """Prometheus series of one prefill instance."""

    def __init__(self, registry: CollectorRegistry, instance: str) -> None:
        labels = {"instance": instance}
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["instance", "source"],
            registry=registry,
        )
        self.requests = Counter(
            "kvserve_prefill_requests",
            "Prefill requests by outcome",
            ["instance", "outcome"],
            registry=registry,
        )
        self.handoff_bytes = Counter(
            "kvserve_handoff_bytes",
            "KV bytes written to decode landing buffers",
            ["instance"],
            registry=registry,
        ).labels(**labels)
        self.handoff_ops = Counter(
            "kvserve_handoff_ops",
            "Transfer ops (each at most 8 MiB) of the handoff",
            ["instance"],
            registry=registry,
        ).labels(**labels)
        self.kv_usage = Gauge(
            "kvserve_kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests",
            ["instance", "role"],
            registry=registry,
        ).labels(instance=instance, role="prefill")
        self.instance = instance

    def count_prompt(self, usage: PromptUsage) -> None:
        for source, n in (
            ("gpu", usage.gpu_tokens),
            ("pool", usage.pool_tokens),
            ("computed", usage.computed_tokens),
        ):
            self.prompt_tokens.labels(instance=self.instance, source=source).inc(n)


def usage_of(out: RequestOutput) -> PromptUsage:
    cached = out.num_cached_tokens
    return PromptUsage(
        prompt_tokens=out.num_prompt_tokens,
        gpu_tokens=cached,
        pool_tokens=0,
        computed_tokens=out.num_prompt_tokens - cached,
    )


class PrefillService:
    """Owns the HTTP routes of a prefill instance over its engine host and handoff table."""

    def __init__(self, name: str, host: EngineHost, handoffs: HandoffTable) -> None:
        self.name = name
        self.host = host
        self.handoffs = handoffs
        self.registry = CollectorRegistry()
        self.metrics = PrefillMetrics(self.registry, name)
        host.engine.kv_observer = handoffs.observe

    def status(self) -> InstanceStatus:
        """Engine thread."""
        e = self.host.engine
        self.metrics.kv_usage.set(e.pool.usage())
        return InstanceStatus(
            name=self.name,
            role="prefill",
            healthy=True,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
        )

    def app(self) -> FastAPI:
        app = base_app(self.host, self.status, self.registry)
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
        queue = self.host.open_stream(rid)

        def add(e: LLMEngine) -> None:
            if msg.landing:
                self.handoffs.add(rid, msg.landing[0])
            try:
                e.add_request(msg.prompt_token_ids, msg.params, rid, prefill_only=True)
            except BaseException:
                self.handoffs.pop(rid)
                raise

        try:
            await self.host.call(add)
        except (InvalidRequestError, PromptTooLongError) as e:
            self.host.close_stream(rid)
            self.metrics.requests.labels(instance=self.name, outcome="rejected").inc()
            return error_response(400, str(e), rid)
        return StreamingResponse(
            self._events(rid, queue, bool(msg.landing)), media_type="application/x-ndjson"
        )

    async def _events(self, rid: str, queue, wants_handoff: bool) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        finished = False
        try:
            out = await queue.get()
            if isinstance(out, BaseException):
                yield encode_line(ErrorEvent(request_id=rid, status=500, message=str(out)))
                finished = True
                return
            handoff = await self.host.call(lambda _e: self.handoffs.pop(rid))
            usage = usage_of(out)
            self.metrics.count_prompt(usage)
            yield encode_line(
                FirstToken(
                    request_id=rid,
                    token_id=out.new_token_ids[0],
                    logprob=out.new_logprobs[0],
                    usage=usage,
                    finish_reason=out.finish_reason,
                )
            )
            finished = True
            if out.finish_reason is not None or not wants_handoff:
                self.metrics.requests.labels(instance=self.name, outcome="finished").inc()
                return
            if handoff is None or handoff.error is not None:
                message = handoff.error if handoff else "no handoff state"
                self.metrics.requests.labels(instance=self.name, outcome="handoff_failed").inc()
                yield encode_line(ErrorEvent(request_id=rid, status=502, message=message or ""))
                return
            self.metrics.handoff_bytes.inc(handoff.num_bytes)
            self.metrics.handoff_ops.inc(handoff.num_ops)
            self.metrics.requests.labels(instance=self.name, outcome="handed_off").inc()
            yield encode_line(handoff.done_event(rid))
        finally:
            self.host.close_stream(rid)
            if not finished:  # the client (router) went away before the first token
                await self.host.call(lambda e: (e.abort(rid), self.handoffs.pop(rid)))
                self.metrics.requests.labels(instance=self.name, outcome="aborted").inc()

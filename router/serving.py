"""Serving one /v1/chat/completions or /v1/completions request, start to finish:

    parse + validate + template + tokenize (preprocess)  ─ 4xx on bad input
    RequestRun over decode + prefill (relay), or        ─ 5xx / worker status on failure
      UnifiedRun over one unified instance (unified)
    OutputStream: tokens -> text with stop rules (output)
    first delta awaited before answering, so a failure before any token is a real HTTP
    status; then SSE chunks as deltas arrive, or one JSON body at the end.
    n > 1: one run per choice, started after choice 0's first token (router/choices.py).

A client that disconnects at any point cancels what is awaited; the run aborts its workers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from modelinfo.detokenizer import RequestOutputText
from modelinfo.info import ModelInfo
from protocol.messages import PromptUsage
from router.api_types import decode_chat, decode_completion
from router.choices import (
    Choice,
    choice_request,
    error_event,
    first_delta,
    full_body,
    num_output_tokens,
    open_rest,
    stream_body,
    usage_of,
)
from router.client_conn import ClientDisconnected, DisconnectWatch, JSONReply, SSEResponse
from router.errors import APIError, Unauthorized
from router.metrics import CLIENT_CLOSED_STATUS, RequestRecord, RouterMetrics
from router.openai_format import ResponseFormatter, formatter_for
from router.output import OutputStream, RequestTiming
from router.policies import RouteContext
from router.preprocess import PreparedRequest, Preprocessor
from router.relay import RelayServices, RequestRun
from router.request_body import GenerationRequest, decode_json, read_json_body
from router.unified import UnifiedRun

log = logging.getLogger(__name__)


@dataclass
class ServingContext:
    """What every request handler shares (built once by the app)."""

    model: ModelInfo
    preprocessor: Preprocessor
    services: RelayServices
    metrics: RouterMetrics
    request_timeout_s: float
    api_key: str | None
    session_headers: tuple[str, ...] = ()
    """Headers naming the client's session, in order of preference (RouterSettings)."""

    def __post_init__(self) -> None:
        self._session_keys = tuple(n.lower().encode("latin-1") for n in self.session_headers)
        self._session_key_set = frozenset(self._session_keys)

    def session_of(self, request: Request | GenerationRequest, user: str | None) -> str | None:
        """The first of `session_headers` the request carries non-empty (each header's
        first occurrence), else `user`. One pass over the request's headers, not one per
        session header (seven by default)."""
        key_set = self._session_key_set
        found: dict[bytes, bytes] | None = None
        for name, value in request.headers.raw:
            if name in key_set:
                if found is None:
                    found = {}
                found.setdefault(name, value)
        if found is not None:
            for key in self._session_keys:
                sent = found.get(key)
                if sent:
                    return sent.decode("latin-1")
        return user

    def check_auth(self, request: Request | GenerationRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        # Constant time: a key must not leak through how fast a wrong guess is refused.
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented, self.api_key.encode()):
            raise Unauthorized(
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                code="invalid_api_key",
            )


def error_response(error: APIError) -> Response:
    return Response(
        error.encode(),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


async def serve_generation(
    ctx: ServingContext, request: GenerationRequest, endpoint: str
) -> Response:
    """The whole life of one generation request; never raises for client or worker faults.

    The work runs in the caller's task, guarded by one DisconnectWatch from the end of
    the body to the end of the response (a streamed one included)."""
    record = RequestRecord(ctx.metrics, endpoint)
    choices: list[Choice] = []
    watch = request.disconnect_watch()
    streaming = False
    try:
        ctx.check_auth(request)
        body = await read_json_body(request)
        if endpoint == "chat":
            prepared = await ctx.preprocessor.chat(decode_json(decode_chat, body))
        else:
            prepared = await ctx.preprocessor.completion(decode_json(decode_completion, body))
        session = ctx.session_of(request, prepared.user)

        def open_choice(index: int) -> tuple[OutputStream, ResponseFormatter]:
            req = choice_request(prepared, index)
            timing = record.timing if index == 0 else RequestTiming(arrival=time.monotonic())
            stream = _open_stream(ctx, req, timing, session)
            return stream, formatter_for(prepared, ctx.model.tokenizer, index)

        stream, fmt = open_choice(0)
        deltas = stream.deltas()
        try:
            if not watch.guard():
                raise ClientDisconnected()
            first = await first_delta(deltas)
            choices.append(Choice(stream, deltas, first, fmt))
            if prepared.n > 1:  # after choice 0's first token: its prompt KV is cached
                await open_rest(prepared, open_choice, choices)
            reply = None if prepared.stream else await full_body(choices)
        except BaseException as e:
            watch.unguard()  # the cleanup's awaits are not the client's to cancel
            await deltas.aclose()
            for c in choices:
                await c.deltas.aclose()
            if isinstance(e, asyncio.CancelledError) and watch.caught():
                raise ClientDisconnected() from None
            raise
        if reply is None:
            watch.unguard()  # the stream guards itself again (SSEResponse)
            streaming = True
            return _streaming_reply(prepared, choices, record, watch)
        usage, num_tokens = _counts(choices)
        return JSONReply(
            reply,
            on_sent=lambda: record.finish(200, usage, num_tokens),
            close=lambda: _close_streams(choices),
        )
    except APIError as e:
        if e.code == "context_length_exceeded":
            ctx.metrics.on_rejected("input_too_long")
        record.finish(e.status, *_counts(choices))
        return error_response(e)
    except ClientDisconnected:
        record.finish(CLIENT_CLOSED_STATUS, *_counts(choices))
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except Exception as e:  # a router bug must still answer in OpenAI's shape
        log.exception("request failed")
        record.finish(500, *_counts(choices))
        return error_response(APIError(f"internal router error: {type(e).__name__}: {e}"))
    finally:
        if not streaming:
            watch.stop()


def _open_stream(
    ctx: ServingContext, req: PreparedRequest, timing: RequestTiming, session_id: str | None
) -> OutputStream:
    route = RouteContext(req.request_id, req.prompt_token_ids, req.user, session_id)
    unified = bool(ctx.services.registry.instances("unified"))
    run_type = UnifiedRun if unified else RequestRun  # one call, or the P/D handoff
    run = run_type(ctx.services, route, req.params, ctx.request_timeout_s)
    model = ctx.model

    def make_text() -> RequestOutputText:
        return RequestOutputText(
            model.tokenizer,
            req.params,
            model.eos_token_ids,
            prompt_token_ids=req.prompt_token_ids,
            skip_special_tokens=req.skip_special_tokens,
        )

    return OutputStream(run, make_text, timing)


def _streaming_reply(
    req: PreparedRequest, choices: list[Choice], record: RequestRecord, watch: DisconnectWatch
) -> Response:
    status = [200]

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in stream_body(req, choices):
                yield chunk
        except APIError as e:
            status[0] = e.status
            yield error_event(e)
        finally:
            for c in choices:
                await c.deltas.aclose()

    def on_end(disconnected: bool) -> None:
        record.finish(CLIENT_CLOSED_STATUS if disconnected else status[0], *_counts(choices))

    async def close() -> None:  # also when `body` never started (the client left first)
        for c in choices:
            await c.deltas.aclose()

    return SSEResponse(body(), on_end, watch, close)


async def _close_streams(choices: list[Choice]) -> None:
    """A whole answer's choices, closed in the request's task once it is sent: each
    stream stopped at its finish delta, and closing it runs the run's cleanup (its
    reservation released, decode's stream closed) now rather than in a task of the event
    loop's async-generator finalizer."""
    try:
        for c in choices:
            await c.deltas.aclose()
    except Exception:  # a router bug: the answer is out, the connection must stay usable
        log.exception("closing the streams of a finished request failed")


def _counts(choices: list[Choice]) -> tuple[PromptUsage | None, int]:
    if not choices:
        return None, 0
    return usage_of(choices), num_output_tokens(choices)

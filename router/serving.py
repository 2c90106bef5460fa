"""Serving one /v1/chat/completions or /v1/completions request, start to finish:

    parse + validate + template + tokenize (preprocess)  ─ 4xx on bad input
    RequestRun over decode + prefill (relay)             ─ 5xx / worker status on failure
    OutputStream: tokens -> text with stop rules (output)
    first delta awaited before answering, so a failure before any token is a real HTTP
    status; then SSE chunks as deltas arrive, or one JSON body at the end.

A client that disconnects at any point cancels what is awaited; the run aborts its workers.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from modelinfo.detokenizer import RequestOutputText
from modelinfo.info import ModelInfo
from protocol.messages import PromptUsage
from router.api_types import decode_chat, decode_completion
from router.client_conn import ClientDisconnected, SSEResponse, race_disconnect
from router.errors import APIError, Unauthorized, WorkerFailed
from router.metrics import CLIENT_CLOSED_STATUS, RequestRecord, RouterMetrics
from router.openai_format import DONE, ResponseFormatter, formatter_for, sse
from router.output import OutputDelta, OutputStream
from router.policies import RouteContext
from router.preprocess import PreparedRequest, Preprocessor
from router.relay import RelayServices, RequestRun
from router.request_body import decode_json, read_json_body

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

    def session_of(self, request: Request, user: str | None) -> str | None:
        for name in self.session_headers:
            value = request.headers.get(name)
            if value:
                return value
        return user

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
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


async def serve_generation(ctx: ServingContext, request: Request, endpoint: str) -> Response:
    """The whole life of one generation request; never raises for client or worker faults."""
    record = RequestRecord(ctx.metrics, endpoint)
    stream: OutputStream | None = None
    try:
        ctx.check_auth(request)
        body = await read_json_body(request)
        if endpoint == "chat":
            prepared = await ctx.preprocessor.chat(decode_json(decode_chat, body))
        else:
            prepared = await ctx.preprocessor.completion(decode_json(decode_completion, body))
        stream = _open_stream(ctx, prepared, record, ctx.session_of(request, prepared.user))
        fmt = formatter_for(prepared, ctx.model.tokenizer)
        deltas = stream.deltas()
        try:
            first = await race_disconnect(request.receive, _first(deltas))
            if prepared.stream:
                return _streaming_reply(prepared, stream, deltas, first, fmt, record)
            return await race_disconnect(
                request.receive, _full_reply(stream, deltas, first, fmt, record)
            )
        except BaseException:
            await deltas.aclose()
            raise
    except APIError as e:
        if e.code == "context_length_exceeded":
            ctx.metrics.on_rejected("input_too_long")
        record.finish(e.status, *_counts(stream))
        return error_response(e)
    except ClientDisconnected:
        record.finish(CLIENT_CLOSED_STATUS, *_counts(stream))
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except Exception as e:  # a router bug must still answer in OpenAI's shape
        log.exception("request failed")
        record.finish(500, *_counts(stream))
        return error_response(APIError(f"internal router error: {type(e).__name__}: {e}"))


def _open_stream(
    ctx: ServingContext, req: PreparedRequest, record: RequestRecord, session_id: str | None
) -> OutputStream:
    route = RouteContext(req.request_id, req.prompt_token_ids, req.user, session_id)
    run = RequestRun(ctx.services, route, req.params, ctx.request_timeout_s)
    text = RequestOutputText(
        ctx.model.tokenizer,
        req.params,
        ctx.model.eos_token_ids,
        prompt_token_ids=req.prompt_token_ids,
        skip_special_tokens=req.skip_special_tokens,
    )
    return OutputStream(run, text, record.timing)


async def _first(deltas: AsyncGenerator[OutputDelta, None]) -> OutputDelta:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        raise WorkerFailed("the workers ended the request without any token") from None


async def _full_reply(
    stream: OutputStream,
    deltas: AsyncGenerator[OutputDelta, None],
    first: OutputDelta,
    fmt: ResponseFormatter,
    record: RequestRecord,
) -> Response:
    parts = [first.text]
    fmt.add_logprobs(first)
    finish = first.finish_reason
    async for delta in deltas:
        parts.append(delta.text)
        fmt.add_logprobs(delta)
        finish = delta.finish_reason
    usage = stream.run.usage
    body = fmt.response("".join(parts), finish, stream.num_output_tokens, usage)
    record.finish(200, *_counts(stream))
    return Response(body, media_type="application/json")


def _streaming_reply(
    req: PreparedRequest,
    stream: OutputStream,
    deltas: AsyncGenerator[OutputDelta, None],
    first: OutputDelta,
    fmt: ResponseFormatter,
    record: RequestRecord,
) -> Response:
    status = [200]

    async def body() -> AsyncIterator[bytes]:
        try:
            delta: OutputDelta | None = first
            head = fmt.stream_start()
            while delta is not None:
                chunk = head + fmt.stream_delta(delta)
                head = b""
                if delta.finish_reason is not None:
                    if req.include_usage:
                        chunk += fmt.stream_usage(stream.num_output_tokens, stream.run.usage)
                    yield chunk + DONE
                    return
                if chunk:
                    yield chunk
                delta = await anext(deltas, None)
            raise WorkerFailed("the workers ended the stream without a finish reason")
        except APIError as e:
            status[0] = e.status
            yield sse(e.body()) + DONE
        finally:
            await deltas.aclose()

    def on_end(disconnected: bool) -> None:
        record.finish(CLIENT_CLOSED_STATUS if disconnected else status[0], *_counts(stream))

    return SSEResponse(body(), on_end)


def _counts(stream: OutputStream | None) -> tuple[PromptUsage | None, int]:
    if stream is None:
        return None, 0
    return stream.run.usage, stream.num_output_tokens

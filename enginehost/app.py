"""The HTTP surface every worker shares: /health, /status, /abort, /metrics, error replies.

A worker builds its FastAPI app with `base_app(...)` and adds its own routes. /health
names the process's incarnation in a header (protocol/incarnation.py) and answers 503,
with the reason as its body, once the engine thread stopped, the instance lost a process
(InstanceLost) or the engine loop stalled (EngineStalled: one step running longer than
the stall timeout); any other route answers those two with a 503 too. Error
answers carry an ErrorEvent body (protocol/messages.py), which the router turns into the
client's status and message. Every route but /health and /metrics needs the cluster
secret (enginehost/auth.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from enginehost.auth import InternalAuth
from enginehost.host import EngineHost, EngineStalled, InstanceLost, RequestIdInUse
from protocol.incarnation import HEADER as INCARNATION_HEADER
from protocol.incarnation import new_incarnation
from protocol.messages import PROTOCOL_VERSION, AbortRequest, ErrorEvent, InstanceStatus

log = logging.getLogger(__name__)

PROCESS_INCARNATION = new_incarnation()
"""This worker process's run (protocol/incarnation.py): in /health's header and in
DecodeReady, so the router tells a restarted instance from the one that died."""


def error_response(status: int, message: str, request_id: str = "") -> Response:
    body = msgspec.json.encode(ErrorEvent(request_id=request_id, status=status, message=message))
    return Response(body, status_code=status, media_type="application/json")


def json_response(obj: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


MAX_MESSAGE_BYTES = 64 << 20
"""Largest body a worker reads (a prompt at the longest contexts is a few MiB of JSON);
larger is a 413 before it is read whole."""


async def _read_body(request: Request) -> bytes | None:
    """The body, or None once it is known to exceed MAX_MESSAGE_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_MESSAGE_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_MESSAGE_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def read_message(request: Request, typ: type[msgspec.Struct]) -> msgspec.Struct | Response:
    """Decode a request body as `typ`, or an error response naming what is wrong
    (including a protocol version other than this worker's, or a body over
    MAX_MESSAGE_BYTES: 413)."""
    body = await _read_body(request)
    if body is None:
        return error_response(413, f"the {typ.__name__} body exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        msg = msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        return error_response(400, f"invalid {typ.__name__}: {e}")
    except msgspec.DecodeError as e:
        return error_response(400, f"malformed JSON for {typ.__name__}: {e}")
    version = getattr(msg, "version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        return error_response(
            400,
            f"{typ.__name__} speaks protocol version {version}, this worker "
            f"{PROTOCOL_VERSION}: run one kvserve version across the cluster",
        )
    return msg


def base_app(
    host: EngineHost,
    status: Callable[[], InstanceStatus],
    registry: CollectorRegistry,
    secret: str,
    on_abort: Callable[[AbortRequest], object] | None = None,
) -> FastAPI:
    """FastAPI app with the shared endpoints behind the cluster secret `secret`.
    `status` runs in the engine thread. `on_abort(msg)` frees what the worker holds
    besides the engine's KV (after the engine aborted the request)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(InternalAuth, secret=secret)

    @app.exception_handler(InstanceLost)
    async def instance_lost(request: Request, exc: InstanceLost) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(EngineStalled)
    async def engine_stalled(request: Request, exc: EngineStalled) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(RequestIdInUse)
    async def request_id_in_use(request: Request, exc: RequestIdInUse) -> Response:
        return error_response(409, str(exc))

    @app.get("/health")
    async def health() -> Response:
        why = host.unhealthy() or ""
        return Response(
            why.encode() or b"ok",
            status_code=503 if why else 200,
            headers={INCARNATION_HEADER: PROCESS_INCARNATION},
        )

    @app.get("/status")
    async def get_status() -> Response:
        return json_response(await host.call(lambda _e: status()))

    @app.post("/abort")
    async def abort(request: Request) -> Response:
        msg = await read_message(request, AbortRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, AbortRequest)
        live = await host.abort(msg.request_id)
        if on_abort is not None:
            on_abort(msg)
        log.info("aborted %s (%s, was live: %s)", msg.request_id, msg.reason, live)
        return Response(b"{}", media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

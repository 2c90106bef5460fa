"""The client's side of one HTTP exchange: noticing a disconnect at once, and streaming SSE.

Both work on raw ASGI `receive`: after the request body, the next message uvicorn gives
is `http.disconnect`, when the client goes away. Whatever the router is waiting on at
that moment (a worker's first token, the next decode batch, a socket write) is cancelled,
so the relay's cleanup aborts the workers within one event-loop turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, awaitable: Awaitable[_T]) -> _T:
    """`awaitable`'s result, or ClientDisconnected (after cancelling it) if the client
    leaves first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


class SSEResponse(Response):
    """A text/event-stream response fed by `body`, an async iterator of ready-made bytes.

    `body` turns its own errors into SSE error events; an exception escaping it is a bug
    (logged). `on_end(disconnected)` runs exactly once when the stream is over; when the
    client left first, `body` was cancelled and closed before it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_end: Callable[[bool], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        # Not Response.__init__: it would add a content-length for an empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]
        self._body = body
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = True
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            try:
                await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
                if not pump.done():
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await pump
            if not pump.cancelled():
                error = pump.exception()
                disconnected = error is not None
                if error is not None and not isinstance(error, OSError):
                    log.error("streaming a response failed", exc_info=error)
        finally:
            self._on_end(disconnected)

    async def _pump(self, send: Send) -> None:
        body = self._body
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose: Any = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

"""The client's side of one HTTP exchange: noticing a disconnect at once, and streaming SSE.

Both work on raw ASGI `receive`: after the request body, the next message uvicorn gives
is `http.disconnect`, when the client goes away. Whatever the router is waiting on at
that moment (a worker's first token, the next decode batch, a socket write) is cancelled,
so the relay's cleanup aborts the workers within one event-loop turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """One watcher task for a request's whole life: when the client goes away it cancels
    the task it guards (wherever that task is waiting: a worker's first token, the next
    decode batch, a socket write), so the request's own `finally` blocks abort the
    workers within one event-loop turn. The request's work runs in its own task, not in
    a task per phase raced against a watcher (two tasks and a wait per phase).

        watch.guard()        the current task is cancelled if the client leaves
        ... await ...        CancelledError: `watch.caught()` says whether it left
        watch.unguard()      still watching; a departure is only noted
        watch.stop()         no more watching
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._cancelled_owner = False
        self.gone = False
        """The client has left (noted whether or not a task was guarded)."""

    def guard(self) -> bool:
        """Guard the current task; False when the client has already left."""
        if self.gone:
            return False
        self._owner = asyncio.current_task()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return True

    def unguard(self) -> None:
        self._owner = None

    def stop(self) -> None:
        self._owner = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def caught(self) -> bool:
        """In the guarded task's `except CancelledError`: True when the cancellation is
        this watch's (the client left); it is then undone, so the task may go on."""
        if not self._cancelled_owner:
            return False
        self._cancelled_owner = False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    def client_left(self) -> None:
        """The client has gone: note it, and cancel the guarded task if there is one."""
        self.gone = True
        if self._owner is not None:
            self._cancelled_owner = True
            self._owner.cancel()

    async def _watch(self) -> None:
        await wait_disconnect(self._receive)
        self._task = None
        self.client_left()


class JSONReply(Response):
    """A whole JSON body; `close()` is awaited and then `on_sent` runs once it was handed
    to the connection (the request's streams closed and its metrics recorded off the
    time to the client's last byte)."""

    def __init__(
        self,
        body: bytes,
        on_sent: Callable[[], None] | None = None,
        status_code: int = 200,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # Not Response.__init__: headers are known, nothing to guess or validate.
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
        ]
        self._on_sent = on_sent
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            await send({"type": "http.response.body", "body": self.body})
        finally:
            try:
                if self._close is not None:
                    await self._close()
            finally:
                if self._on_sent is not None:
                    self._on_sent()


class SSEResponse(Response):
    """A text/event-stream response fed by `body`, an async iterator of ready-made bytes.

    `body` turns its own errors into SSE error events; an exception escaping it is a bug
    (logged). `on_end(disconnected)` runs exactly once when the stream is over, after
    `body` was closed and `close()` awaited (what `body` would close, for when it never
    started: the client left first). `watch` (the request's DisconnectWatch) notices the
    client leaving; it is stopped at the end.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        on_end: Callable[[bool], None],
        watch: DisconnectWatch,
        close: Callable[[], Awaitable[None]] | None = None,
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
        self._watch = watch
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = True
        watch = self._watch
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if watch.guard():
                try:
                    async for chunk in self._body:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    disconnected = False
                except asyncio.CancelledError:
                    if not watch.caught():
                        raise
                except OSError:
                    pass
                except Exception:
                    log.exception("streaming a response failed")
        finally:
            watch.stop()
            try:
                await self._body.aclose()
                if self._close is not None:
                    await self._close()
            finally:
                self._on_end(disconnected)

"""The generation routes served by the router's HTTP protocol itself, without ASGI.

Why: per request, uvicorn's ASGI cycle costs an ASGI scope (a dict, a copy of the app
state, the URL parsed again), a RequestResponseCycle with its asyncio.Event, a
`receive()` per body message, a watcher task to notice a disconnect (a task created,
stepped and cancelled per request), and two `send()` calls that check every header
against regular expressions; then the app's own dispatch. For the two routes that carry
the traffic (POST /v1/chat/completions and /v1/completions, exact path, no query) none of
that is needed: `GenerationRoutes.on_headers_complete` gives the request a
`GenerationCycle` instead, whose task runs `serve_generation` with a `DirectRequest`
(headers and the body the parser collected), notices a disconnect from the protocol's
own `connection_lost` (no task), and writes the response itself.

Everything else stays uvicorn's and the app's: every other method, path or URL form,
upgrades and `limit_concurrency` get the ASGI cycle and FastAPI (admin, /metrics,
/health, /v1/models, OpenAPI, 404 / 405), and the connection's handling is shared by
both kinds of cycle: keep-alive and its timer, pipelining (a request parsed while the
previous response is unfinished waits, reading paused), flow control, and the HTTP
limits of router/http_limits.py (which sit above this class and see either cycle).

`GenerationCycle` offers what uvicorn's protocol reads and writes of a cycle:
`body`, `more_body`, `message_event.set()`, `response_started`, `response_complete`,
`disconnected`, `keep_alive`, `run_asgi(app)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import Message
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.client_conn import ClientDisconnected, DisconnectWatch
from router.request_body import Headers
from router.serving import ServingContext, serve_generation

log = logging.getLogger(__name__)

ROUTES = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}
"""Raw request target -> serve_generation's endpoint name (an exact match: anything with
a query, escapes or an absolute form takes the ASGI path, which routes it the same)."""

_SCOPE = {"type": "http", "method": "POST"}
"""What a Response's `__call__` reads of the scope."""


class NotifiedWatch(DisconnectWatch):
    """A DisconnectWatch told of the client's departure by the connection itself
    (`GenerationCycle.set`) rather than by a task awaiting `receive()`."""

    def __init__(self) -> None:
        super().__init__(_no_receive)

    def guard(self) -> bool:
        if self.gone:
            return False
        self._owner = asyncio.current_task()
        return True

    def stop(self) -> None:
        self._owner = None


async def _no_receive() -> dict[str, Any]:
    raise RuntimeError("a NotifiedWatch is told of disconnects, it does not receive")


class DirectRequest:
    """What `serve_generation` reads of a request (as RawRequest offers it): headers, the
    body (awaited until complete), and the watch that notices the client leaving."""

    __slots__ = ("_cycle", "headers")

    def __init__(self, cycle: GenerationCycle, headers: list[tuple[bytes, bytes]]) -> None:
        self._cycle = cycle
        self.headers = Headers(headers)

    async def body(self) -> bytes:
        """The whole body; ClientDisconnected if the client leaves before its end."""
        return await self._cycle.read_body()

    def disconnect_watch(self) -> DisconnectWatch:
        return self._cycle.watch


class GenerationCycle:
    """One generation request on a connection: its body as parsed, its task, its answer.
    Event-loop thread only."""

    def __init__(
        self,
        serving: ServingContext,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        transport: asyncio.Transport,
        flow: FlowControl,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
        on_response: Callable[[], None],
    ) -> None:
        self._serving = serving
        self._endpoint = endpoint
        self._headers = headers
        self.transport = transport
        self.flow = flow
        self._default_headers = default_headers
        """uvicorn's server and date headers, as its cycle sends them."""
        self.keep_alive = keep_alive
        self._expect_100 = expect_100_continue
        self.on_response = on_response
        self.message_event = self
        """uvicorn's protocol calls `message_event.set()` on body bytes, at the body's
        end and when the connection is lost: `set` below."""
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._chunked = False
        self._waiter: asyncio.Future[None] | None = None
        self.watch = NotifiedWatch()

    # -- told by the protocol ---------------------------------------------------------------

    def set(self) -> None:
        """Body bytes, the body's end, or the connection lost."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.disconnected and not self.watch.gone:
            self.watch.client_left()

    # -- the request's task -----------------------------------------------------------------

    async def run_asgi(self, app: Any) -> None:
        """The task uvicorn's protocol starts (now, or when the pipelined request before
        it is answered). `app` is unused: the request never reaches it."""
        try:
            response = await serve_generation(
                self._serving, DirectRequest(self, self._headers), self._endpoint
            )
            await response(_SCOPE, _no_receive, self.send)
        except BaseException as exc:
            log.error("serving a generation request failed", exc_info=exc)
            if not self.response_started and not self.disconnected:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                self.transport.close()
        finally:
            self.on_response = _nothing

    async def read_body(self) -> bytes:
        if self.disconnected:  # as uvicorn's receive(): gone before the app read
            raise ClientDisconnected()
        while self.more_body and not self.disconnected:
            if self._expect_100 and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._expect_100 = False
            self.flow.resume_reading()  # paused past uvicorn's high-water mark
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.more_body:  # the client left mid-body
            raise ClientDisconnected()
        # A large body's last bytes may have paused reading: read on, so that the client
        # leaving is seen while the request runs (uvicorn's receive() does the same).
        self.flow.resume_reading()
        body = bytes(self.body)
        self.body = bytearray()
        return body

    async def send(self, message: Message) -> None:
        """A Response's ASGI messages, written as uvicorn writes them. Only
        `serve_generation`'s own responses come here: their headers are the router's,
        not a client's, so they are not checked again."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            self.response_started = True
            self._expect_100 = False
            status = message["status"]
            content = [STATUS_LINE[status]]
            chunked = True
            for name, value in (*self._default_headers, *message.get("headers", ())):
                if name == b"content-length":
                    chunked = False
                elif name == b"connection" and b"close" in value.lower():
                    self.keep_alive = False
                content.extend((name, b": ", value, b"\r\n"))
            if not self.keep_alive:
                content.append(b"connection: close\r\n")
            if chunked and status not in (204, 304):
                content.append(b"transfer-encoding: chunked\r\n")
            else:
                chunked = False
            content.append(b"\r\n")
            self._chunked = chunked
            self.transport.write(b"".join(content))
            return
        if self.response_complete:
            raise RuntimeError("a message after the response was complete")
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self._chunked:
            if body:
                self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            if not more_body:
                self.transport.write(b"0\r\n\r\n")
        elif body:
            self.transport.write(body)
        if not more_body:
            self.response_complete = True
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    async def _send_500(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", b"21"),
                    (b"connection", b"close"),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})


def _nothing() -> None:
    pass


def _serving_of(app: Any) -> ServingContext | None:
    """The router app's ServingContext, through uvicorn's middleware wrappers (each keeps
    the app it wraps as `.app`); None for any other app."""
    for _ in range(8):
        serving = getattr(app, "serving", None)
        if serving is not None:
            return serving  # type: ignore[no-any-return]
        app = getattr(app, "app", None)
        if app is None:
            break
    return None


class GenerationRoutes(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the generation routes given a GenerationCycle.
    The ASGI scope is built only for the requests that take the ASGI path."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._serving = _serving_of(self.app)
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_headers_complete(self) -> None:
        parser = self.parser
        serving = self._serving
        endpoint = ROUTES.get(self.url)
        if (
            endpoint is None
            or serving is None
            or parser.get_method() != b"POST"
            or parser.should_upgrade()
            or self.limit_concurrency is not None
        ):
            self._asgi_scope()
            super().on_headers_complete()
            return
        version = parser.get_http_version()
        existing = self.cycle
        self.cycle = GenerationCycle(  # type: ignore[assignment]
            serving,
            endpoint,
            self.headers,
            self.transport,
            self.flow,
            self.server_state.default_headers,
            keep_alive=version != "1.0" and parser.should_keep_alive(),
            expect_100_continue=self.expect_100_continue,
            on_response=self.on_response_complete,
        )
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, self.app)  # type: ignore[arg-type]
        else:  # pipelined: starts when the previous response is complete
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, self.app))  # type: ignore[arg-type]

    def _asgi_scope(self) -> None:
        """The scope uvicorn's on_message_begin would have built."""
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

"""Limits on what one client connection may send before the app sees it.

uvicorn's httptools protocol bounds neither the header block, nor the body, nor how long
either may take: a client that sends half a request line, or declares 10 MB and sends
9, holds a connection and a task forever, and a body of any size is buffered whole
before the app can refuse it. `GuardedHttpToolsProtocol` adds, per request:

    connection made / previous response done
        │  header_timeout_s: the request line + headers must be complete (408)
        │  max_header_bytes: bytes before the end of the headers (431)
        ▼
    headers complete ── Content-Length > max_body_bytes ──▶ 413 at once, body unread
        │  body_timeout_s: the whole body must arrive (408)
        │  max_body_bytes: counted as chunks arrive (413; chunked bodies too)
        ▼
    body complete ──▶ the app (router/serving.py); idle keep-alive: uvicorn's timer

A refusal is an OpenAI-shaped JSON error sent before any response byte of the app, with
`Connection: close`; the connection is then closed, so the app (if it was already
awaiting the body) sees a disconnect and frees what it holds. Once the app has started
its response, a timer only closes the connection.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HttpLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request bounds of the public API's HTTP layer (RouterSettings.http_limits)."""

    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 32 * 1024 * 1024
    """Largest request body; a larger declared Content-Length is refused unread."""
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024
    """Request line + headers."""
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """From the connection (or the previous response) to the end of the headers."""
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """From the end of the headers to the end of the body."""


_LINGER_S = 2.0
"""How long a refused connection keeps draining the client's bytes before it closes."""


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (class attribute `limits`, set by
    `guarded_protocol`). Event-loop thread only, like its base."""

    limits: HttpLimits = HttpLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        """Raw bytes read while the headers were incomplete (one read may overshoot)."""
        self._parsed_header_bytes = 0
        """Request line + headers as parsed (exact, checked when they are complete)."""
        self._body_bytes = 0
        self._phase = "headers"
        """headers -> body -> app (the app has the request) -> headers (next request)."""
        self._refused = False
        self._app_has_request = False
        """The current request reached the app (its cycle is `self.cycle`)."""
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase == "headers":
            # Bytes of earlier reads that did not finish the headers (this read may end
            # them and carry body bytes): the header block is bounded to one read over.
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse_headers()
                return
            self._header_bytes += len(data)
        super().data_received(data)
        # A phase's timer starts only when a read leaves it unfinished: a request whose
        # headers and body came in this read arms none (a timer armed and cancelled per
        # request was ~2 of the router's 5 per request). Its clock is this read's time,
        # which is when it would have started anyway (the start of the headers of a
        # keep-alive connection's next request, or their end for the body).
        if self._timer is None and not self._refused:
            phase = self._phase
            if phase == "headers":
                self._arm(self.limits.header_timeout_s, "headers")
            elif phase == "body":
                self._arm(self.limits.body_timeout_s, "body")

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._body_bytes = 0
        self._parsed_header_bytes = 0
        super().on_message_begin()

    # on_url and on_header do what uvicorn's do, inline rather than through super(): a
    # Python call less per header line (httptools calls them for every request).

    def on_url(self, url: bytes) -> None:
        self._parsed_header_bytes += len(url)
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._phase = "body"
        self._header_bytes = 0
        if self._parsed_header_bytes > self.limits.max_header_bytes:
            self._refuse_headers()
            return
        declared = self._content_length()
        if declared is not None and declared > self.limits.max_body_bytes:
            self._refuse(413, "Content Too Large", self._too_large(), "request_too_large")
            return
        # The header timer is done; the body's starts when a read ends with the body
        # unfinished (data_received).
        self._disarm()
        super().on_headers_complete()
        self._app_has_request = True

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            self._refuse(413, "Content Too Large", self._too_large(), "request_too_large")
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._phase = "app"
        if self._refused:
            return
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._phase = "headers"  # the next request's header timer starts with its bytes
        self._app_has_request = False

    def _content_length(self) -> int | None:
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def _refuse_headers(self) -> None:
        self._refuse(
            431,
            "Request Header Fields Too Large",
            f"the request line and headers exceed {self.limits.max_header_bytes} bytes",
            "headers_too_large",
        )

    def _too_large(self) -> str:
        return f"the request body exceeds {self.limits.max_body_bytes} bytes"

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str) -> None:
        self._timer = None
        seconds = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        if phase == "headers" and self._header_bytes == 0:
            self.transport.close()  # an idle fresh connection: nothing to answer
            return
        self._refuse(
            408,
            "Request Timeout",
            f"the request {phase} did not arrive within {seconds:g} s",
            "request_timeout",
        )

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        """Answer `status` unless the app already answered, then close the connection."""
        self._refused = True
        self._disarm()
        if self.transport.is_closing():
            return
        if not self._app_has_request or not self.cycle.response_started:
            self.transport.write(_error(status, reason, message, code))
        # Lingering close: closing with unread request bytes in the socket would send a
        # reset that can destroy the answer before the client reads it. Half-close, drop
        # what still arrives (data_received ignores it), close when the client does or
        # after a grace period.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._timer = self.loop.call_later(_LINGER_S, self.transport.close)
        else:
            self.transport.close()


def guarded_protocol(limits: HttpLimits, base: type[GuardedHttpToolsProtocol]) -> type:
    """`base` with `limits` (a subclass, so servers with different limits can coexist)."""
    return type(base.__name__, (base,), {"limits": limits})

"""A minimal HTTP/1.1 client for the worker serving path (admit, prefill, decode).

Why not httpx here: on the 2-core dev machine httpx does ~600 calls/s on one connection
and ~120 calls/s with 32 concurrent requests through one pool (its pool bookkeeping grows
with concurrency), while the same calls over plain asyncio reach ~6,000-9,000/s. The
router makes three worker calls per request, so httpx alone would cap it near 40 req/s.
httpx stays for the low-rate control calls (health, abort, admin).

What it does: keep-alive connections pooled per (host, port); POST with a body;
response status and body, the body streamed as it arrives (chunked or Content-Length),
parsed by httptools (the parser uvicorn uses), one parser per connection. A reused idle
connection that turns out closed before any response byte is retried once on a fresh one
(the server never read the request). Timeouts: connecting is bounded here; with a
deadline, the whole exchange (`Response.expire_at`), watched by one timer per pool for
all its exchanges (`DeadlineClock`); cancelling closes the connection.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

_MAX_BUFFERED_CHUNKS = 256
"""Unread body chunks after which reading from the socket pauses (flow control)."""
_STALE = "the connection closed before any response byte"
_MAX_TARGETS = 1024
"""URLs whose POST head is kept (Http1Pool._target)."""


class ConnectFailed(OSError):
    """No connection could be made (refused, unreachable, timed out): the server never
    saw the request."""


class ConnectionBroken(OSError):
    """The connection failed after the request was sent, or the answer was not HTTP."""


_EARLY_S = 0.001
"""A timer may fire up to a millisecond early (the event loop's clock has millisecond
ticks): a deadline within that of now counts as passed."""


class DeadlineClock:
    """Owns the deadlines of a pool's exchanges and one timer, armed at the earliest.

    Why not a timer per exchange: arming and cancelling an event-loop timer per worker
    call (two per request) cost more than the dict entry that replaces it. Every exchange
    of a request shares the request's deadline and later requests have later ones, so
    the one timer is re-armed only when it fires (at the oldest exchange's deadline,
    which has usually ended by then: a scan of the live ones, then the timer goes to the
    earliest of them). Event-loop thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._live: dict[Response, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf

    def add(self, resp: Response, deadline: float) -> None:
        self._live[resp] = deadline
        if deadline < self._at:
            self._arm(deadline)

    def discard(self, resp: Response) -> None:
        self._live.pop(resp, None)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._at = math.inf
        now = self._loop.time() + _EARLY_S
        live = self._live
        for resp in [r for r, deadline in live.items() if deadline <= now]:
            del live[resp]
            resp._expire()
        if live:
            self._arm(min(live.values()))


class Response:
    """One response: `status`, then the body via `chunks()` or `read()`. `close()` must be
    called (it returns a finished keep-alive connection to the pool)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        # The connection's loop, not asyncio.get_running_loop(): CPython 3.11 checks
        # getpid() (a system call) on every get_running_loop, several times a response.
        self._loop = conn.loop
        self.status = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._headers_done: asyncio.Future[None] = self._loop.create_future()
        self.complete = False
        self.error: Exception | None = None
        self.got_bytes = False
        self._clock: DeadlineClock | None = None
        """Set while a deadline is watched (`expire_at`)."""

    def expire_at(self, deadline: float) -> None:
        """Waiting for the headers or reading the body past `deadline` (loop time) raises
        TimeoutError: one deadline for the whole response, not one per chunk (a streamed
        answer has a chunk per token), watched by the pool's DeadlineClock."""
        if self._clock is None and not self.complete:
            self._clock = self._conn.deadlines
            self._clock.add(self, deadline)

    def _expire(self) -> None:
        self._clock = None
        self._fail(TimeoutError("the response did not end before its deadline"))

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                if len(self._chunks) <= _MAX_BUFFERED_CHUNKS // 2:
                    self._conn.resume()
                yield self._chunks.popleft()
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_some(self) -> bytes:
        """Every body byte that arrived since the last call (waiting for some), b"" once
        the body is complete. One await per socket read, where `chunks()` is one async
        generator step per parser callback. The serving path inlines this loop (`take`,
        `arrival`): a coroutine less per read."""
        while (data := self.take()) is None:
            await self.arrival()
        return data

    def take(self) -> bytes | None:
        """Every body byte that arrived since the last call; b"" once the body is
        complete; None while nothing came yet (await `arrival()`, then take again).
        Raises the exchange's error once what arrived before it was taken."""
        chunks = self._chunks
        if not chunks:
            if self.error is not None:
                raise self.error
            return b"" if self.complete else None
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._conn.resume()
        return data

    def arrival(self) -> asyncio.Future[None]:
        """Done when more of the body, its end or an error arrives. A waiter left
        cancelled (the reader was) is never set: `_wake` skips done ones."""
        self._waiter = waiter = self._loop.create_future()
        return waiter

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        self._disarm()
        self._conn.release(self)

    def _disarm(self) -> None:
        if self._clock is not None:
            self._clock.discard(self)
            self._clock = None

    # -- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None and not self.complete:
            self.error = error
        if not self._headers_done.done():
            self._headers_done.set_exception(error)
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive TCP connection; at most one exchange at a time."""

    def __init__(self, pool: Http1Pool, key: tuple[str, int]) -> None:
        self.loop = asyncio.get_running_loop()
        self._pool = pool
        self.deadlines = pool.deadlines(self.loop)
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        """One parser for the connection's responses, as llhttp reads a keep-alive
        connection's messages one after another; a fresh one only after a message began
        outside an exchange (`on_message_begin`), which may have left it mid-message."""
        self._parser_dirty = False
        self._response: Response | None = None
        self._paused = False
        self._keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self._response is not None:
            self._response.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._abandon(ConnectionBroken(f"invalid HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None:
            self._response._fail(
                ConnectionBroken(f"connection closed by the server ({exc or 'EOF'})")
            )

    # httptools callbacks
    def on_message_begin(self) -> None:
        resp = self._response
        if resp is None or resp.complete:  # bytes the server sent unasked
            self._parser_dirty = True

    def on_headers_complete(self) -> None:
        resp = self._response
        if resp is not None:
            resp.status = self._parser.get_status_code()
            if not resp._headers_done.done():
                resp._headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self._response
        if resp is not None:
            resp._chunks.append(body)
            if len(resp._chunks) >= _MAX_BUFFERED_CHUNKS and not self._paused:
                self._paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            waiter = resp._waiter  # resp._wake(), inline: once per body chunk
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        resp = self._response
        if resp is not None:
            resp.complete = True
            # llhttp answers this only inside the callbacks.
            self._keep_alive = self._parser.should_keep_alive()
            resp._wake()

    # used by Response / pool
    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def release(self, resp: Response) -> None:
        if self._response is not resp:
            return
        self._response = None
        if resp.complete and resp.error is None and self._keep_alive and not self.closed:
            self._pool._idle[self.key].append(self)
        else:
            self._abandon(None)

    def send(self, request: bytes) -> Response:
        assert self.transport is not None and self._response is None
        if self._parser_dirty:
            self._parser = httptools.HttpResponseParser(self)
            self._parser_dirty = False
        self._keep_alive = False
        self._response = Response(self)
        self.transport.write(request)
        return self._response

    def _abandon(self, error: Exception | None) -> None:
        self.closed = True
        if error is not None and self._response is not None:
            self._response._fail(error)
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Owns keep-alive connections to the workers. Event-loop bound, no locks."""

    def __init__(self, connect_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._extra_head = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in (headers or {}).items()
        )
        """Header lines every request carries (the cluster secret)."""
        self._idle: dict[tuple[str, int], list[_Connection]] = collections.defaultdict(list)
        self._addresses: dict[str, tuple[str, int]] = {}
        self._targets: dict[tuple[str, bytes], tuple[tuple[str, int], bytes]] = {}
        self._deadlines: DeadlineClock | None = None

    def deadlines(self, loop: asyncio.AbstractEventLoop) -> DeadlineClock:
        """The clock of this pool's exchanges (on the loop its connections use)."""
        if self._deadlines is None or self._deadlines._loop is not loop:
            self._deadlines = DeadlineClock(loop)
        return self._deadlines

    async def post(
        self,
        url: str,
        body: bytes,
        content_type: bytes = b"application/json",
        deadline: float | None = None,
    ) -> Response:
        """POST `body` to `url`; returns once the response headers arrived. With a
        `deadline` (loop time), connecting, the headers and the body's reading all end by
        then (TimeoutError): one deadline for the whole exchange, no timeout scope."""
        target = self._targets.get((url, content_type))
        if target is None:
            target = self._target(url, content_type)
        key, start = target
        request = b"%scontent-length: %d\r\n%s\r\n%s" % (start, len(body), self._extra_head, body)
        conn = self._take_idle(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(key, deadline)
            resp = conn.send(request)
            if deadline is not None:
                resp.expire_at(deadline)
            try:
                await resp._headers_done
            except ConnectionBroken:
                resp._disarm()
                conn._abandon(None)
                if resp.got_bytes:
                    raise
                if reused:  # a stale keep-alive connection: the server never read it
                    conn, reused = None, False
                    continue
                raise ConnectionBroken(_STALE) from None
            except BaseException:  # deadline, cancelled (client gone): the exchange is lost
                resp._disarm()
                conn._abandon(None)
                raise
            return resp

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn._abandon(None)
        self._idle.clear()

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, key: tuple[str, int], deadline: float | None) -> _Connection:
        """A new connection (rare: most exchanges reuse one), by `deadline` if given."""
        if deadline is None:
            return await self._connect_in_time(key)
        async with asyncio.timeout_at(deadline):
            return await self._connect_in_time(key)

    async def _connect_in_time(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), *key)
        except TimeoutError:
            raise ConnectFailed(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {e.strerror or e}") from None
        return conn

    def _target(self, url: str, content_type: bytes) -> tuple[tuple[str, int], bytes]:
        """(host, port) of `url` and the head of a POST to it up to its Content-Length,
        kept per URL: the serving path posts to a few URLs, over and over."""
        key, path = self._split(url)
        start = b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: %s\r\n" % (
            path.encode(),
            key[0].encode(),
            key[1],
            content_type,
        )
        if len(self._targets) >= _MAX_TARGETS:  # URLs from elsewhere: stay bounded
            self._targets.clear()
        self._targets[url, content_type] = (key, start)
        return key, start

    def _split(self, url: str) -> tuple[tuple[str, int], str]:
        base, _, rest = url.partition("://")
        hostport, slash, path = rest.partition("/")
        key = self._addresses.get(hostport)
        if key is None:
            parts = urlsplit(f"{base}://{hostport}")
            key = (parts.hostname or "127.0.0.1", parts.port or 80)
            self._addresses[hostport] = key
        return key, slash + path if slash else "/"

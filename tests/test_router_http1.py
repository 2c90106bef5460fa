"""router/http1.py, the serving-path HTTP/1.1 client: keep-alive reuse, streamed bodies
with flow control, stale connections, refused connections, broken answers, cancellation."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from router_standin import ServerThread

from router.http1 import ConnectFailed, ConnectionBroken, Http1Pool


class _App:
    """Raw ASGI: /echo returns the body; /stream sends `n` chunks; counts connections."""

    def __init__(self) -> None:
        self.clients: set[Any] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.add(scope["client"])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/stream":
            n = int(body)
            for i in range(n):
                await send({"type": "http.response.body", "body": b"%d\n" % i, "more_body": True})
        elif scope["path"] == "/slow":
            await asyncio.sleep(30)
        else:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def server() -> Any:
    app = _App()
    with ServerThread(app, timeout_keep_alive=1, timeout_graceful_shutdown=1) as s:
        s.app_obj = app  # type: ignore[attr-defined]
        yield s


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_keep_alive_reuses_one_connection(server: Any) -> None:
    async def go() -> list[bytes]:
        pool = Http1Pool(1.0)
        out = []
        for i in range(5):
            resp = await pool.post(server.url + "/echo", b"hello %d" % i)
            out.append(await resp.read())
            resp.close()
        pool.close()
        return out

    before = len(server.app_obj.clients)
    assert _run(go()) == [b"hello %d" % i for i in range(5)]
    assert len(server.app_obj.clients) == before + 1


def test_streamed_body_with_flow_control(server: Any) -> None:
    async def go() -> bytes:
        pool = Http1Pool(1.0)
        resp = await pool.post(server.url + "/stream", b"3000")
        data = b""
        async for chunk in resp.chunks():
            data += chunk
            await asyncio.sleep(0)
        resp.close()
        pool.close()
        return data

    assert _run(go()) == b"".join(b"%d\n" % i for i in range(3000))


def test_stale_keep_alive_connection_is_retried() -> None:
    """The server answers once, then drops that connection when the next request comes
    (its idle timeout firing at the same moment): the request is retried on a new one."""

    async def go() -> tuple[bytes, int]:
        connections = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            writer.close()  # the second request on this connection is never answered

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/x"
        pool = Http1Pool(1.0)
        try:
            for _ in range(2):
                resp = await pool.post(url, b"")
                data = await resp.read()
                resp.close()
        finally:
            pool.close()
            srv.close()
        return data, connections

    assert _run(go()) == (b"ok", 2)


def test_refused_connection_is_connect_failed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> None:
        await Http1Pool(1.0).post(f"http://127.0.0.1:{port}/x", b"")

    with pytest.raises(ConnectFailed, match="cannot connect"):
        _run(go())


def test_garbage_answer_is_connection_broken() -> None:
    async def go() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            resp = await Http1Pool(1.0).post(f"http://127.0.0.1:{port}/x", b"")
            await resp.read()
        finally:
            srv.close()

    with pytest.raises(ConnectionBroken):
        _run(go())


def test_one_parser_per_connection_and_a_fresh_one_after_stray_bytes() -> None:
    """A keep-alive connection's responses go through one parser; bytes the server sends
    between exchanges (the start of a response nobody asked for) leave that parser
    mid-message, so the next exchange on the connection parses with a fresh one."""

    async def go() -> list[bytes]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for i in range(4):
                await reader.readuntil(b"\r\n\r\n")
                answer = b"answer %d" % i
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
                )
                if i == 1:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
                await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        pool = Http1Pool(1.0)
        out = []
        try:
            for i in range(4):
                resp = await pool.post(f"http://127.0.0.1:{port}/x", b"")
                out.append(await resp.read())
                resp.close()
                if i == 1:
                    await asyncio.sleep(0.05)  # the stray bytes arrive while it is idle
            conns = pool._idle[("127.0.0.1", port)]
            assert len(conns) == 1 and conns[0]._parser_dirty is False
        finally:
            pool.close()
            srv.close()
        return out

    assert _run(go()) == [b"answer %d" % i for i in range(4)]


def test_cancelled_request_closes_its_connection(server: Any) -> None:
    async def go() -> int:
        pool = Http1Pool(1.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                resp = await pool.post(server.url + "/slow", b"")
                await resp.read()
        resp.close()
        idle = len(pool._idle[("127.0.0.1", server.port)])
        pool.close()
        return idle

    assert _run(go()) == 0


def test_deadlines_of_a_pool_expire_each_at_its_own_time(server: Any) -> None:
    """One clock watches every exchange's deadline: one that ended in time is forgotten,
    an earlier deadline added after a later one still expires first, and each expires
    at its own deadline, not before."""

    async def go() -> tuple[float, float]:
        pool = Http1Pool(1.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        done = await pool.post(server.url + "/echo", b"x", deadline=t0 + 5.0)
        assert await done.read() == b"x"
        done.close()
        late = await pool.post(server.url + "/slow", b"", deadline=t0 + 0.9)
        early = await pool.post(server.url + "/slow", b"", deadline=t0 + 0.5)

        async def expiry(resp: Any) -> float:
            try:
                await resp.read()
            except TimeoutError:
                return float(loop.time() - t0)
            finally:
                resp.close()
            raise AssertionError("the body ended before its deadline")

        at_early, at_late = await asyncio.gather(expiry(early), expiry(late))
        pool.close()
        return at_early, at_late

    at_early, at_late = _run(go())
    assert 0.49 <= at_early < 0.85
    assert 0.89 <= at_late < 1.6

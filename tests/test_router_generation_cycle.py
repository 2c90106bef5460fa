"""The generation routes served by the router's HTTP protocol without ASGI
(router/generation_cycle.py), on raw sockets against the real router (uvicorn, uvloop,
httptools) and stand-in workers: which requests take that path, keep-alive, pipelining
(mixed with ASGI requests), bodies that arrive late, chunked or after 100-continue,
HTTP/1.0, a client leaving before its answer, and the TokenBatches of one read joined."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from router_standin import RouterHarness

import router.fast_path
from protocol.messages import ErrorEvent, TokenBatch
from router.worker_client import merge_batches

BODY = json.dumps(
    {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4, "temperature": 0}
).encode()


@pytest.fixture(scope="module")
def h() -> Iterator[RouterHarness]:
    harness = RouterHarness()
    yield harness
    harness.close()


@pytest.fixture(autouse=True)
def fresh(h: RouterHarness) -> None:
    h.reset()


def _connect(h: RouterHarness) -> socket.socket:
    return socket.create_connection(("127.0.0.1", h.router.port), timeout=10)


def _request(path: str = "/v1/completions", body: bytes = BODY, extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


class Reader:
    """Whole responses off one connection (Content-Length or chunked bodies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> None:
        data = self.sock.recv(65536)
        assert data, f"closed with {self.buf!r} unread"
        self.buf += data

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._more()
        out, _, self.buf = self.buf.partition(marker)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        head = self._until(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        if b"content-length" in headers:
            return status, headers, self._exactly(int(headers[b"content-length"]))
        assert headers.get(b"transfer-encoding") == b"chunked", headers
        body = b""
        while True:
            size = int(self._until(b"\r\n"), 16)
            body += self._exactly(size)
            assert self._exactly(2) == b"\r\n"
            if size == 0:
                return status, headers, body


def _text(h: RouterHarness, body: bytes) -> str:
    return str(json.loads(body)["choices"][0]["text"])


def _expected(h: RouterHarness) -> str:
    r = h.openai().completions.create(model=h.served_name, prompt="hi", max_tokens=4)
    return str(r.choices[0].text)


def test_generation_routes_skip_asgi_and_the_rest_take_it(
    h: RouterHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the ASGI app's generation handler broken, the exact routes are still served
    (by the protocol); a query string or another method takes the ASGI path."""

    async def broken(*_: Any) -> Any:
        raise RuntimeError("the ASGI path was taken")

    expected = _expected(h)
    monkeypatch.setattr(router.fast_path, "serve_generation", broken)
    with _connect(h) as sock:
        r = Reader(sock)
        sock.sendall(_request())
        status, headers, body = r.response()
        assert status == 200 and headers[b"content-type"] == b"application/json"
        assert _text(h, body) == expected
        assert b"server" in headers and b"date" in headers  # as uvicorn's cycle sends
        sock.sendall(_request("/v1/completions?x=1"))
        assert r.response()[0] == 500  # FastAPI's path: the broken handler
    with _connect(h) as sock:
        r = Reader(sock)
        sock.sendall(b"GET /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = r.response()
        assert status == 405 and "error" in json.loads(body)


def test_keep_alive_and_pipelining_mixed_with_asgi_requests(h: RouterHarness) -> None:
    """Five requests in one write (generation and others): five answers, in order, on
    the one connection."""
    expected = _expected(h)
    stream_body = json.loads(BODY) | {"stream": True}
    with _connect(h) as sock:
        r = Reader(sock)
        sock.sendall(
            _request()
            + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            + _request("/v1/completions", json.dumps(stream_body).encode())
            + _request("/v1/nothing")
            + _request()
        )
        status, _, body = r.response()
        assert status == 200 and _text(h, body) == expected
        status, _, body = r.response()
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, headers, body = r.response()
        assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == expected
        assert r.response()[0] == 404
        status, _, body = r.response()
        assert status == 200 and _text(h, body) == expected


def test_body_after_the_headers_chunked_and_after_100_continue(h: RouterHarness) -> None:
    expected = _expected(h)
    with _connect(h) as sock:
        r = Reader(sock)
        # The body a moment after the headers (the request's task waits for it).
        request = _request()
        split = request.index(b"\r\n\r\n") + 4 + 5
        sock.sendall(request[:split])
        time.sleep(0.2)
        sock.sendall(request[split:])
        status, _, body = r.response()
        assert status == 200 and _text(h, body) == expected
        # Chunked, in two writes.
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (10, BODY[:10])
        )
        time.sleep(0.1)
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY) - 10, BODY[10:]))
        status, _, body = r.response()
        assert status == 200 and _text(h, body) == expected
        # Expect: 100-continue: the body only once the router asked for it.
        sock.sendall(_request(extra="expect: 100-continue\r\n")[: -len(BODY)])
        assert r._until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue"
        sock.sendall(BODY)
        status, _, body = r.response()
        assert status == 200 and _text(h, body) == expected


def test_http_1_0_is_answered_and_closed(h: RouterHarness) -> None:
    expected = _expected(h)
    with _connect(h) as sock:
        sock.sendall(_request().replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        r = Reader(sock)
        status, headers, body = r.response()
        assert status == 200 and headers[b"connection"] == b"close"
        assert _text(h, body) == expected
        assert sock.recv(1) == b""  # closed after the answer


@pytest.mark.parametrize("padding", [0, 200_000], ids=["small", "past-the-high-water-mark"])
def test_client_leaving_before_its_answer_aborts_the_workers(
    h: RouterHarness, padding: int
) -> None:
    """Also with a body large enough to pause reading while it arrived (JSON whitespace):
    reading goes on once it is whole, so the departure is still seen."""
    h.set_output(list(range(100, 600)), token_delay_s=0.02)
    body = json.dumps(json.loads(BODY) | {"max_tokens": 500}).encode() + b" " * padding
    closed_before = _client_closed(h)
    with _connect(h) as sock:
        sock.sendall(_request(body=body))
        deadline = time.monotonic() + 5
        while not h.decode[0].received:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    closed = time.monotonic()
    request_id = h.decode[0].received[0][1].request_id
    while request_id not in h.decode[0].aborted_ids():
        assert time.monotonic() - closed < 2.0, "decode was not told of the departure"
        time.sleep(0.005)
    assert _client_closed(h) == closed_before + 1  # counted as the client's, not a 5xx


def _client_closed(h: RouterHarness) -> float:
    """Requests the router counted as closed by the client (status 499)."""
    text = h.openai()._client.get(h.url + "/metrics").text  # type: ignore[attr-defined]
    found = re.findall(r'kvserve_router_requests_total\{[^}]*status="499"[^}]*\} (\S+)', text)
    return sum(float(v) for v in found)


def test_token_batches_of_one_read_are_joined_in_order() -> None:
    def batch(i: int, finish: str | None = None, top: Any = None) -> TokenBatch:
        return TokenBatch("r", [i], [float(i)], finish, i, top_logprobs=top)

    merged = merge_batches([batch(1), batch(2), batch(3, "stop"), batch(4)])
    assert [b.token_ids for b in merged] == [[1, 2, 3], [4]]  # nothing after a finish
    assert merged[0].logprobs == [1.0, 2.0, 3.0] and merged[0].finish_reason == "stop"
    assert merged[0].num_output_tokens == 3 and merged[0].top_logprobs is None
    error = ErrorEvent("r", 500, "x")
    merged = merge_batches([batch(1), error, batch(2), batch(3, top=[[(7, -0.5)]])])
    assert merged[:2] == [batch(1), error]
    assert merged[2].token_ids == [2, 3] and merged[2].top_logprobs == [None, [(7, -0.5)]]
    short = TokenBatch("r", [5, 6], [], None, 2)  # a worker that sent no logprobs
    assert merge_batches([short, batch(7)])[0].logprobs == [None, None, 7.0]


def test_one_task_per_request_and_the_streams_closed_in_it(h: RouterHarness) -> None:
    """A finished request's worker streams are closed in its own task: no task of the
    event loop's async-generator finalizer per request (a task, and a wake-up of the
    loop through its self-pipe), JSON or streamed. The one other task of a request is
    its prefill call, sent beside decode's (router/relay.py)."""
    loop = h.router.server.servers[0].get_loop()
    names: list[str] = []

    def factory(lp: Any, coro: Any, **kwargs: Any) -> Any:
        names.append(getattr(coro, "__qualname__", type(coro).__name__))
        return asyncio.Task(coro, loop=lp, **kwargs)

    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (loop.set_task_factory(factory), done.set()))
    assert done.wait(5)
    try:
        sock = _connect(h)
        reader = Reader(sock)
        for stream in (False, True, False, True):
            body = json.loads(BODY)
            body["stream"] = stream
            sock.sendall(_request(body=json.dumps(body).encode()))
            status, _, _ = reader.response()
            assert status == 200
        sock.close()
        time.sleep(0.2)  # a finalizer's task would have run by now
    finally:
        loop.call_soon_threadsafe(loop.set_task_factory, None)
    per_request = [n for n in names if n not in ("KVWatcher._follow", "WorkerClient.health")]
    assert per_request == ["GenerationCycle.run_asgi", "RequestRun._open_prefill"] * 4, names

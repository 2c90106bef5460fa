"""The router's HTTP limits (router/http_limits.py, router/request_body.py) against raw
sockets: oversized, slow, partial and odd requests get an OpenAI-shaped 4xx (or a closed
idle connection) within the configured time, are never counted as server errors, and
the router keeps serving meanwhile."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from router_standin import RouterHarness

from router.http_limits import HttpLimits

LIMITS = HttpLimits(
    max_body_bytes=64 * 1024, max_header_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5
)
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def h() -> Iterator[RouterHarness]:
    harness = RouterHarness(http_limits=LIMITS)
    yield harness
    harness.close()


def _connect(h: RouterHarness) -> socket.socket:
    return socket.create_connection(("127.0.0.1", h.router.port), timeout=5)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (the test fails on a hang)."""
    out = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return out
        out += data


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (headers + Content-Length bytes), which must say it closes."""
    out = b""
    while b"\r\n\r\n" not in out:
        data = sock.recv(65536)
        assert data, f"closed before a whole response: {out!r}"
        out += data
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        data = sock.recv(65536)
        assert data, "closed mid-body"
        body += data
    assert b"connection: close" in head.lower()
    return head + b"\r\n\r\n" + body


def _status_and_error(raw: bytes) -> tuple[int, dict]:  # type: ignore[type-arg]
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _head(length: int | None, extra: str = "") -> bytes:
    lines = [f"POST {CHAT} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _server_errors(h: RouterHarness) -> float:
    text = httpx.get(h.url + "/metrics", trust_env=False).text
    return sum(
        float(v)
        for v in re.findall(
            r'^kvserve_router_requests_total\{[^}]*status="5\d\d"[^}]*\} (\S+)$', text, re.M
        )
    )


def _healthy_fast(h: RouterHarness) -> None:
    t0 = time.monotonic()
    assert httpx.get(h.url + "/health", trust_env=False, timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0


def test_declared_body_over_the_limit_is_413_before_it_is_sent(h: RouterHarness) -> None:
    with _connect(h) as s:
        s.sendall(_head(10 * 1024 * 1024))  # headers only: the body is never sent
        t0 = time.monotonic()
        status, err = _status_and_error(_read_response(s))
    assert status == 413 and err["code"] == "request_too_large"
    assert str(LIMITS.max_body_bytes) in err["message"]
    assert time.monotonic() - t0 < LIMITS.body_timeout_s  # answered, not timed out
    _healthy_fast(h)


def test_chunked_body_over_the_limit_is_413(h: RouterHarness) -> None:
    chunk = b"x" * 16384
    head = f"POST {CHAT} HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
    head += "transfer-encoding: chunked\r\n\r\n"
    with _connect(h) as s:
        s.sendall(head.encode())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(8):  # 128 KiB in 16 KiB chunks; it may close before the last
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, err = _status_and_error(_read_response(s))
    assert status == 413 and err["code"] == "request_too_large"


def test_partial_headers_time_out_with_408(h: RouterHarness) -> None:
    with _connect(h) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode())
        t0 = time.monotonic()
        status, err = _status_and_error(_read_response(s))
        waited = time.monotonic() - t0
    assert status == 408 and err["code"] == "request_timeout" and "headers" in err["message"]
    assert LIMITS.header_timeout_s * 0.8 < waited < LIMITS.header_timeout_s + 2


def test_body_shorter_than_declared_times_out_with_408_not_a_500(h: RouterHarness) -> None:
    before = _server_errors(h)
    with _connect(h) as s:
        s.sendall(_head(1000) + b'{"model": "x", ')  # 15 of the 1000 declared bytes
        t0 = time.monotonic()
        status, err = _status_and_error(_read_response(s))
        waited = time.monotonic() - t0
    assert status == 408 and "body" in err["message"]
    assert waited < LIMITS.body_timeout_s + 2
    _healthy_fast(h)
    assert _server_errors(h) == before


def test_client_leaving_mid_body_is_not_a_server_error(h: RouterHarness) -> None:
    before = _server_errors(h)
    with _connect(h) as s:
        s.sendall(_head(1000) + b'{"model": "x", ')
        time.sleep(0.1)
    time.sleep(0.3)
    _healthy_fast(h)
    assert _server_errors(h) == before


def test_header_block_over_the_limit_is_431(h: RouterHarness) -> None:
    big = "".join(f"x-filler-{i}: {'v' * 100}\r\n" for i in range(80))  # ~9 KB
    with _connect(h) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(_head(2, big))
        status, err = _status_and_error(_read_response(s))
    assert status == 431 and err["code"] == "headers_too_large"


def test_idle_connections_are_closed_and_serving_goes_on(h: RouterHarness) -> None:
    socks = [_connect(h) for _ in range(50)]
    try:
        _healthy_fast(h)  # 50 silent connections hold nothing up
        t0 = time.monotonic()
        for s in socks:
            assert _read_all(s) == b""  # closed without an answer: nothing was asked
        assert time.monotonic() - t0 < LIMITS.header_timeout_s + 3
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_that_is_not_json_is_415(h: RouterHarness, content_type: str) -> None:
    body = {"model": h.served_name, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        h.url + CHAT,
        content=json.dumps(body),
        headers={"content-type": content_type},
        trust_env=False,
    )
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_json_content_types_are_served(h: RouterHarness) -> None:
    h.reset()
    h.set_output([100, 101, 102])
    body = {
        "model": h.served_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    }
    for ct in ("application/json", "application/json; charset=utf-8", None):
        headers = {"content-type": ct} if ct else {}
        r = httpx.post(h.url + CHAT, content=json.dumps(body), headers=headers, trust_env=False)
        assert r.status_code == 200, (ct, r.text)


@pytest.mark.parametrize("depth", [1000, 30_000])
def test_deeply_nested_json_is_400(h: RouterHarness, depth: int) -> None:
    # Inside a field that takes any JSON (an unknown field is refused before its value)
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"a": '
        + b"[" * depth
        + b"]" * depth
        + b"}]}"
    )
    before = _server_errors(h)
    r = httpx.post(
        h.url + CHAT, content=body, headers={"content-type": "application/json"}, trust_env=False
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
    assert _server_errors(h) == before


def test_the_header_callbacks_record_what_uvicorns_do() -> None:
    """GuardedHttpToolsProtocol's on_url / on_header do uvicorn's work inline (no super()
    call per header): the same URL, headers (names lower-cased, order and case of values
    kept) and 100-continue flag as uvicorn's own callbacks."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from router.http_limits import GuardedHttpToolsProtocol

    lines = [
        (b"Host", b"x"),
        (b"Content-Type", b"Application/JSON"),
        (b"EXPECT", b"100-Continue"),
        (b"x-a", b"1"),
        (b"X-A", b"2"),
    ]
    states = []
    for cls in (GuardedHttpToolsProtocol, HttpToolsProtocol):
        proto = object.__new__(cls)
        proto.url, proto.headers, proto.expect_100_continue = b"", [], False
        proto._parsed_header_bytes = 0
        for part in (b"/v1/comp", b"letions"):
            cls.on_url(proto, part)
        for name, value in lines:
            cls.on_header(proto, name, value)
        states.append((proto.url, proto.headers, proto.expect_100_continue))
    assert states[0] == states[1]
    assert states[0][2] is True and states[0][1][1] == (b"content-type", b"Application/JSON")

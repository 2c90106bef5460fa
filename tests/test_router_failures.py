"""Failures around the router: client disconnects abort the workers at once; dead,
refusing, crashing, erroring or slow workers give fast, clear 5xx (or their own status),
never a hang; unhealthy instances are routed around and come back when healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from router_standin import RouterHarness, ServerThread

PROMPT = {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 500}


@pytest.fixture
def h() -> Iterator[RouterHarness]:
    harness = RouterHarness()
    yield harness
    harness.close()


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.005)
    return time.monotonic() - start


def _stream_then_disconnect(url: str, num_chunks: int) -> str:
    """Start a streaming completion, read `num_chunks` SSE events, drop the connection."""
    body = {**PROMPT, "stream": True}
    with (
        httpx.Client(trust_env=False, timeout=10) as client,
        client.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        seen: list[str] = []
        while len(seen) < num_chunks:
            line = next(lines)
            if line.startswith("data: "):
                seen.append(line)
    return seen[0].split('"id":"')[1].split('"')[0]


def test_client_disconnect_mid_stream_aborts_both_workers(h: RouterHarness) -> None:
    h.set_output(list(range(100, 600)), token_delay_s=0.02)
    request_id = _stream_then_disconnect(h.url, 3)
    closed_at = time.monotonic()
    for worker in (h.prefill[0], h.decode[0]):
        _wait_for(lambda w=worker: request_id in w.aborted_ids(), 1.0)
        at, abort = next((t, a) for t, a in worker.aborts if a.request_id == request_id)
        assert at - closed_at < 1.0 and abort.reason == "client_disconnected"
    assert len(h.decode[0].received) == 1  # one /decode call, nothing after the abort


def test_client_disconnect_before_first_token_aborts(h: RouterHarness) -> None:
    h.set_output([100, 101], prefill_delay_s=30)
    with (
        httpx.Client(trust_env=False) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post(h.url + "/v1/completions", json=PROMPT, timeout=0.3)
    _wait_for(lambda: len(h.prefill[0].aborts) == 1 and len(h.decode[0].aborts) == 1, 1.0)

    def metrics() -> str:
        return httpx.get(h.url + "/metrics", trust_env=False).text

    _wait_for(lambda: "kvserve_router_requests_in_flight 0.0" in metrics(), 1.0)
    assert 'kvserve_router_requests_total{endpoint="completion",status="499"} 1.0' in metrics()


def test_refused_connection_is_a_fast_503(h: RouterHarness) -> None:
    h.worker_servers[1].stop()  # the only decode instance
    start = time.monotonic()
    r = httpx.post(h.url + "/v1/completions", json=PROMPT, trust_env=False, timeout=10)
    assert time.monotonic() - start < 1.0
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "server_error" and "decode" in error["message"]
    # Marked unhealthy: the next request fails without trying to connect.
    r = httpx.post(h.url + "/v1/completions", json=PROMPT, trust_env=False, timeout=10)
    assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"]
    assert httpx.get(h.url + "/health", trust_env=False).json()["decode"]["healthy"] == 0


def test_dead_prefill_is_routed_around_and_restored() -> None:
    h = RouterHarness(num_prefill=2, health_interval_s=0.2)
    try:
        dead = h.worker_servers[0]
        port = dead.port
        dead.stop()
        for _ in range(4):  # round robin would hit the dead one every other request
            r = h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)
            assert r.choices[0].finish_reason == "length"
        assert len(h.prefill[1].received) == 4
        registry = h.app.state.registry
        assert not registry.instances("prefill")[0].healthy
        revived = ServerThread(h.prefill[0].app(), port=port)
        revived.start()
        h.worker_servers[0] = revived
        _wait_for(lambda: registry.instances("prefill")[0].healthy, 2.0)
        for _ in range(2):
            h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)
        assert len(h.prefill[0].received) == 1
    finally:
        h.close()


def test_health_poll_that_never_answers_marks_the_instance_down() -> None:
    """A worker whose port stays open but whose /health never answers (timed-out polls):
    the first timeout stops routing to it, three in a row mark it down, so a request
    bound to that decode while it waits for prefill fails with a 503 instead of waiting
    out its deadline; a prefill that stops answering is routed around."""
    h = RouterHarness(num_prefill=2, health_interval_s=0.2, health_timeout_s=0.3)
    try:
        registry = h.app.state.registry
        silent_prefill, decode = registry.instances("prefill")[0], registry.instances("decode")[0]
        h.prefill[1].prefill_delay_s = 30.0  # the request waits at prefill, bound to decode
        h.prefill[0].health_delay_s = 1.0  # past the 0.3 s health timeout
        _wait_for(lambda: not silent_prefill.healthy, 5.0)
        assert "Timeout" in (silent_prefill.last_error or "")
        results: list[httpx.Response] = []
        t0 = time.monotonic()

        def send() -> None:
            results.append(httpx.post(h.url + "/v1/completions", json=PROMPT, timeout=60))

        waiter = threading.Thread(target=send)
        waiter.start()
        _wait_for(lambda: len(h.prefill[1].received) == 1, 5.0)  # the healthy prefill
        assert h.prefill[0].received == []
        h.decode[0].health_delay_s = 1.0
        silenced = time.monotonic()
        waiter.join(20)
        assert results, "the request bound to the silent decode still waits"
        r = results[0]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "decode_instance_lost"
        assert time.monotonic() - t0 < 15  # 3 timed-out polls, not the 30 s prefill
        # 3 polls of router.health_timeout_s (0.3 s); with the default 1 s, at least 3 s
        assert time.monotonic() - silenced < 2.9
        assert not decode.healthy and "3 timed-out health polls in a row" in (
            decode.last_error or ""
        )
        body = httpx.get(h.url + "/health", trust_env=False, timeout=5).json()
        assert body["decode"]["healthy"] == 0 and body["prefill"]["healthy"] == 1
        h.prefill[0].health_delay_s = h.decode[0].health_delay_s = 0.0
        _wait_for(lambda: silent_prefill.healthy and decode.healthy, 10.0)
    finally:
        h.close()


def test_worker_error_event_status_reaches_client(h: RouterHarness) -> None:
    h.set_output([100, 101, 102], fail={"prefill": (400, "prompt too long for the KV cache")})
    r = httpx.post(h.url + "/v1/completions", json=PROMPT, trust_env=False)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "prompt too long for the KV cache"
    _wait_for(lambda: len(h.decode[0].aborts) == 1, 1.0)  # its landing is freed
    h.set_output([100, 101, 102], fail={"decode": (503, "decode KV is full")})
    with pytest.raises(openai.InternalServerError, match="decode KV is full"):
        h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)


def test_decode_crash_mid_stream(h: RouterHarness) -> None:
    h.set_output(list(range(100, 200)), crash_decode_after=3)
    start = time.monotonic()
    r = httpx.post(h.url + "/v1/completions", json=PROMPT, trust_env=False, timeout=10)
    assert r.status_code == 502 and time.monotonic() - start < 1.0
    assert "decode instance d0" in r.json()["error"]["message"]
    # Streaming: the first token went out with a 200, so the error comes as an SSE event.
    h.reset()
    h.set_output(list(range(100, 200)), crash_decode_after=3)
    with pytest.raises(openai.APIError, match="decode instance d0"):
        list(
            h.openai().completions.create(
                model=h.served_name, prompt="x", max_tokens=50, stream=True
            )
        )


def test_request_timeout_is_504_and_aborts() -> None:
    h = RouterHarness(request_timeout_s=0.5)
    try:
        h.set_output(list(range(100, 200)), token_delay_s=0.2)
        start = time.monotonic()
        r = httpx.post(h.url + "/v1/completions", json=PROMPT, trust_env=False, timeout=10)
        assert r.status_code == 504 and time.monotonic() - start < 1.5
        _wait_for(lambda: any(a.reason == "timeout" for _, a in h.decode[0].aborts), 1.0)
    finally:
        h.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_killed_worker_process_mid_stream_is_a_fast_error() -> None:
    """SIGKILL a real decode process while the router relays its stream: the stream's
    own failure ends the request and marks the instance down. Health polls are an hour
    apart here, so neither the error nor the mark can come from one; "fast" is then
    seconds against the 600 s request timeout, with room for a loaded machine."""
    port = _free_port()
    script = Path(__file__).with_name("router_standin.py")
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent)}
    proc = subprocess.Popen([sys.executable, str(script), str(port), "1000", "0.01"], env=env)
    h = RouterHarness(health_interval_s=3600.0)
    try:
        registry = h.app.state.registry
        registry.instances("decode")[0].url = f"http://127.0.0.1:{port}"  # the process
        _wait_for(lambda: _is_up(port), 15.0)
        with httpx.Client(trust_env=False, timeout=10) as client:
            body = {**PROMPT, "stream": True, "max_tokens": 900}
            with client.stream("POST", h.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(5):
                    next(lines)
                proc.kill()
                killed_at = time.monotonic()
                rest = list(lines)
        assert time.monotonic() - killed_at < 5.0
        errors = [line for line in rest if line.startswith('data: {"error"')]
        assert len(errors) == 1 and "decode instance d0" in errors[0]
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert not registry.instances("decode")[0].healthy
    finally:
        proc.kill()
        proc.wait()
        h.close()


def _is_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_instance_that_starts_after_the_router_is_seen_at_once(caplog) -> None:  # type: ignore[no-untyped-def]
    """`kvserve up` starts the router beside the workers. The router polls every instance
    once before it serves (so its first requests avoid one not up yet), then often until
    each has answered once: with an hour between regular polls, a prefill that comes up
    after the router is still routed to within a second. Not answering yet is logged as
    waiting, not as a failure; once all have answered, polls return to the interval."""
    caplog.set_level("INFO", logger="router.health")
    h = RouterHarness(num_prefill=1, late_prefill=1, health_interval_s=3600.0)
    try:
        registry = h.app.state.registry
        early, late = registry.instances("prefill")
        assert early.healthy and not late.healthy  # the sweep before serving
        assert h.app.state.health.interval_s < 0.1
        for _ in range(2):
            r = h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)
            assert r.choices[0].finish_reason == "length"
        assert len(h.late[0].received) == 0
        h.start_late()
        _wait_for(lambda: late.healthy, 1.0)
        for _ in range(2):  # round robin over both now
            h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)
        assert len(h.late[0].received) == 1
        assert h.app.state.health.interval_s == 3600.0
    finally:
        h.close()
    about_late = [r for r in caplog.records if "instance p1" in r.getMessage()]
    assert [r.levelname for r in about_late] == ["INFO", "INFO"], about_late
    assert "waiting for prefill instance p1" in about_late[0].getMessage()
    assert about_late[1].getMessage().endswith("answers")

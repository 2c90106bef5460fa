"""The router's P/D run with both worker calls at once (protocol 5, router/relay.py),
against stand-in workers: decode and prefill are sent the request together; decode's
DecodeReady goes to prefill as a LandingGrant; the client's first token waits for that
grant's 200; grant refusals, decode failures and disconnects abort both instances, and
decode hears whether a prefill may write into its landing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from router_standin import RouterHarness

TOKENS = [100, 101, 102, 103]


@pytest.fixture(scope="module")
def harness() -> Iterator[RouterHarness]:
    h = RouterHarness()
    yield h
    h.close()


@pytest.fixture
def h(harness: RouterHarness) -> RouterHarness:
    harness.reset()
    harness.set_output(TOKENS)
    return harness


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _complete(h: RouterHarness, max_tokens: int = 4, **body: object) -> httpx.Response:
    req = {"model": h.served_name, "prompt": [5, 6, 7], "max_tokens": max_tokens, **body}
    return httpx.post(h.url + "/v1/completions", json=req, trust_env=False, timeout=10)


def _rid(h: RouterHarness) -> str:
    ((_, req),) = h.decode[0].received
    return str(req.request_id)


def test_prefill_computes_while_decode_reserves(h: RouterHarness) -> None:
    h.decode[0].ready_delay_s = 0.3
    r = _complete(h)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    rid = _rid(h)
    prefill, decode = h.prefill[0], h.decode[0]
    ((kind, req),) = prefill.received
    assert kind == "prefill" and req.request_id == rid
    assert req.await_landing and req.landing == [] and req.notify_url == ""
    # prefill had the request while decode was still reserving, not after DecodeReady
    assert prefill.arrivals["prefill", rid] < decode.readies[rid] - 0.2
    (grant,) = prefill.landings
    assert grant.request_id == rid and len(grant.landing) == 1
    assert grant.notify_url.endswith("/kv_notify")
    assert prefill.arrivals["landing", rid] >= decode.readies[rid]
    assert not prefill.aborts and not decode.aborts  # a run that ends well aborts nothing


def test_the_grant_does_not_wait_for_prefills_answer(h: RouterHarness) -> None:
    prefill = h.prefill[0]
    prefill.prefill_delay_s, prefill.prefill_answers_late = 0.4, True  # headers with it
    assert _complete(h).status_code == 200
    rid = _rid(h)
    assert prefill.arrivals["landing", rid] < prefill.arrivals["prefill", rid] + 0.3


def test_the_first_token_waits_for_the_grant(h: RouterHarness) -> None:
    h.decode[0].ready_delay_s = 0.3  # prefill's FirstToken is in long before DecodeReady
    req = {"model": h.served_name, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    with (
        httpx.Client(trust_env=False, timeout=10) as client,
        client.stream("POST", h.url + "/v1/completions", json=req) as r,
    ):
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(lines)
        first_at = time.monotonic()
        rest = list(lines)
    rid = _rid(h)
    assert first_at >= h.prefill[0].arrivals["landing", rid] >= h.decode[0].readies[rid]
    assert rest and '"finish_reason":"length"' in rest[-1]


@pytest.mark.parametrize("status", [403, 409])
def test_a_refused_grant_fails_the_run_and_aborts_both(h: RouterHarness, status: int) -> None:
    h.prefill[0].fail["landing"] = (status, "landing refused: altered")
    r = _complete(h)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert f"refused decode's landing for the request ({status})" in message
    assert "landing refused: altered" in message
    rid = _rid(h)
    _wait_for(lambda: rid in h.prefill[0].aborted_ids() and rid in h.decode[0].aborted_ids(), 2)
    (abort,) = [a for _, a in h.decode[0].aborts]
    assert abort.prefill_contacted  # the grant went out: a write may be in flight


def test_a_grant_answered_5xx_is_the_workers_error(h: RouterHarness) -> None:
    h.prefill[0].fail["landing"] = (503, "engine loop stalled: no progress for 2.4 s")
    r = _complete(h)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == "engine loop stalled: no progress for 2.4 s"
    rid = _rid(h)
    _wait_for(lambda: rid in h.prefill[0].aborted_ids() and rid in h.decode[0].aborted_ids(), 2)


def test_a_gone_grant_yields_to_prefills_answer(h: RouterHarness) -> None:
    h.prefill[0].fail["landing"] = (410, "request has ended here")
    r = _complete(h)  # prefill's first token did not finish the request: nothing to decode
    assert r.status_code == 502 and "(410)" in r.json()["error"]["message"], r.text
    h.reset()
    h.set_output([2, 101, 102])  # the first token is EOS: prefill ended the request itself
    h.prefill[0].fail["landing"] = (410, "request has ended here")
    r = _complete(h)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    rid = _rid(h)
    _wait_for(lambda: rid in h.decode[0].aborted_ids(), 2)  # decode's pages are freed


def test_decode_failing_before_its_ready_aborts_the_prefill(h: RouterHarness) -> None:
    h.decode[0].fail["decode"] = (503, "decode is full")
    r = _complete(h)
    assert r.status_code == 503 and "decode is full" in r.json()["error"]["message"]
    _wait_for(lambda: len(h.prefill[0].aborts) == 1, 2)
    assert not h.prefill[0].landings  # no landing was ever forwarded
    (abort,) = [a for _, a in h.decode[0].aborts]
    assert not abort.prefill_contacted  # no prefill can write there: reused at once


def test_a_client_gone_before_decode_ready_tells_decode_no_prefill_writes(
    h: RouterHarness,
) -> None:
    h.decode[0].ready_delay_s = 2.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            h.url + "/v1/completions",
            json={"model": h.served_name, "prompt": [5], "max_tokens": 4},
            trust_env=False,
            timeout=0.3,
        )
    _wait_for(lambda: len(h.decode[0].aborts) == 1 and len(h.prefill[0].aborts) == 1, 2)
    (abort,) = [a for _, a in h.decode[0].aborts]
    assert abort.reason == "client_disconnected" and not abort.prefill_contacted
    assert not h.prefill[0].landings


def test_max_tokens_one_goes_to_prefill_alone(h: RouterHarness) -> None:
    r = _complete(h, max_tokens=1)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert not h.decode[0].received and not h.prefill[0].landings
    ((_, req),) = h.prefill[0].received
    assert not req.await_landing and req.landing == []

"""The admission gate through the real router: a request waits for decode KV headroom,
gets 429 + Retry-After when the wait runs out, 400 when it can never fit, and the
output-token limit is enforced. Stand-in workers report a tiny decode KV capacity."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from router_standin import RouterHarness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def harness():
    h = RouterHarness(admission_wait_timeout_s=0.6, kv_poll_interval_s=0.05, max_output_tokens=80)
    yield h
    h.close()


def _post(h: RouterHarness, max_tokens: int) -> httpx.Response:
    return httpx.post(
        h.url + "/v1/completions",
        json={"model": h.served_name, "prompt": [5] * 10, "max_tokens": max_tokens},
        trust_env=False,
        timeout=30,
    )


def _wait_capacity_known(h: RouterHarness) -> None:
    view = h.app.state.view
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(view.state(i).info is not None for i in h.app.state.registry.instances("decode")):
            return
        time.sleep(0.02)
    raise AssertionError("the router never read the decode instance's /info")


def test_wait_then_429_with_retry_after_then_admitted(harness: RouterHarness) -> None:
    h = harness
    h.reset()
    h.decode[0].kv_capacity_tokens = 100  # budget 90 tokens of prompt + max_tokens
    h.set_output(list(range(100, 160)), token_delay_s=0.05)  # the first request takes ~1.5 s
    h.app.state.view.states.clear()  # forget what was learned before this test
    _wait_capacity_known(h)
    first: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: first.append(_post(h, 60)))  # 70 tokens
    holder.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    busy = _post(h, 60)  # 70 more: over the budget until the first one ends
    waited = time.monotonic() - t0
    assert busy.status_code == 429, busy.text
    assert int(busy.headers["retry-after"]) >= 1
    assert busy.json()["error"]["type"] == "rate_limit_error"
    assert 0.5 < waited < 3
    holder.join(30)
    assert first and first[0].status_code == 200
    assert _post(h, 60).status_code == 200  # room again
    metrics = httpx.get(h.url + "/metrics", trust_env=False).text
    assert 'kvserve_router_admission_rejections_total{reason="wait_timeout"}' in metrics


def test_larger_than_any_budget_is_400_and_output_limit(harness: RouterHarness) -> None:
    h = harness
    h.reset()
    h.decode[0].kv_capacity_tokens = 50
    h.app.state.view.states.clear()
    _wait_capacity_known(h)
    r = _post(h, 60)  # 70 > 45: can never fit
    assert r.status_code == 400 and "decode budget" in r.json()["error"]["message"]
    r = _post(h, 81)  # over admission.max_output_tokens
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.fixture(scope="module")
def fits_first():
    h = RouterHarness(
        admission_wait_timeout_s=1.2,
        admission_order="fits_first",
        admission_pass_bound_s=10.0,
        kv_poll_interval_s=0.05,
    )
    yield h
    h.close()


def test_fits_first_lets_a_small_request_pass_a_large_head(fits_first: RouterHarness) -> None:
    """router.admission.order fits_first through the real router: a small request that
    fits passes a large one waiting at the head (under fifo it would wait behind it); the
    large one still gets fifo's 429 + Retry-After when its wait runs out, and a request
    no budget can hold fifo's 400; every reservation is given back."""
    h = fits_first
    h.reset()
    h.decode[0].kv_capacity_tokens = 100  # budget 90 tokens of prompt + max_tokens
    h.set_output(list(range(100, 160)), token_delay_s=0.05)  # a 60-token request ~3 s
    h.app.state.view.states.clear()
    _wait_capacity_known(h)
    done: dict[str, tuple[float, int]] = {}

    def post(name: str, max_tokens: int) -> None:
        r = _post(h, max_tokens)
        done[name] = (time.monotonic(), r.status_code)

    holder = threading.Thread(target=post, args=("holder", 60))  # 70 tokens
    holder.start()
    time.sleep(0.3)
    big = threading.Thread(target=post, args=("big", 60))  # 70 more: waits at the head
    big.start()
    time.sleep(0.2)
    post("small", 5)  # 15 tokens: 70 + 15 fit, so it passes the waiting head
    assert done["small"][1] == 200 and "holder" not in done and "big" not in done
    big.join(30)
    holder.join(30)
    assert done["big"][1] == 429 and done["holder"][1] == 200
    assert done["small"][0] < done["holder"][0]
    view = h.app.state.view
    decode = h.app.state.registry.instances("decode")
    deadline = time.monotonic() + 5  # released when the router's stream ends, just after
    while any(view.state(i).reserved_tokens for i in decode) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(view.state(i).reserved_tokens == 0 for i in decode)
    h.decode[0].kv_capacity_tokens = 50
    view.states.clear()
    _wait_capacity_known(h)
    r = _post(h, 60)  # 70 > 45: can never fit
    assert r.status_code == 400 and "decode budget" in r.json()["error"]["message"]

"""benchmarks/pool_policy_sim.py on small traces: caches that hold everything reuse
exactly the trace ceiling, and Mooncake's eviction model keeps the pool under its
watermark while client retention keeps it under its budget."""

from __future__ import annotations

import random

import pytest

from benchmarks.agentic.synthetic import generate
from benchmarks.pool_policy_sim import Model, Policy, Pool, simulate


def _trace():  # type: ignore[no-untyped-def]
    return generate(sessions=6, turns=4, max_context=8000, seed=3)


def test_caches_that_hold_everything_reach_the_ceiling() -> None:
    trace = _trace()
    big = Model(gpu_blocks=10**6, pool_objects=10**6, save_slots=None)
    for policy in (Policy("through", "mooncake"), Policy("through", "client")):
        r = simulate(trace, policy, big)
        assert r.requests == trace.num_requests
        assert (r.gpu + r.pool) / r.prompt == r.ceiling
    # No GPU cache: everything reused comes from the pool, in whole 256-token chunks
    # (below the ceiling by the rounding, which is large for these ~1-3K-token prompts).
    r = simulate(trace, Policy("through", "client"), Model(gpu_blocks=0, pool_objects=10**6))
    assert r.gpu == 0 and 0.5 * r.ceiling < r.pool / r.prompt < r.ceiling


def test_small_pool_and_gpu_cache_lose_reuse() -> None:
    trace = _trace()
    small = Model(gpu_blocks=64, pool_objects=40, save_slots=None)
    r = simulate(trace, Policy("through", "client"), small)
    assert 0 < (r.gpu + r.pool) / r.prompt < r.ceiling


def test_mooncake_eviction_keeps_under_the_watermark_and_client_under_its_budget() -> None:
    moon = Pool(1000, random.Random(0))
    client = Pool(1000, random.Random(0), client_budget=0.85)
    for i in range(5000):
        moon.put([i], float(i), 0)
        client.put([i], float(i) + 100.0, i % 10, stamp=float(i))
        assert len(moon.objs) <= 0.9 * 1000 + 1
        assert len(client.objs) <= 850
    # Client retention removes the least recent first: what is left is the newest.
    assert min(client.objs) > 5000 - 900


def test_waiting_saves_drop_nothing_and_reuse_at_least_as_much() -> None:
    """Two slots and a slow save thread: dropping leaves holes; waiting drops nothing,
    loses only what the GPU cache evicted first, and reuses at least as much."""
    trace = _trace()
    slow = {"gpu_blocks": 400, "pool_objects": 10**6, "save_slots": 2, "save_gbs": 0.05}
    drop = simulate(trace, Policy("through", "client"), Model(save_wait=False, **slow))
    wait = simulate(trace, Policy("through", "client"), Model(save_wait=True, **slow))
    assert drop.save_dropped > 0 and drop.save_deferred == 0
    assert wait.save_dropped == 0 and wait.save_deferred > 0
    assert wait.pool >= drop.pool
    fast = simulate(trace, Policy("through", "client"), Model(**{**slow, "save_gbs": 1e6}))
    assert fast.save_deferred == 0 and fast.save_lost == 0


def test_step_queue_serves_every_request_and_shortest_cuts_the_queue() -> None:
    """The engine-step model of the prefill instance (benchmarks/pool_sim_queue.py): every
    discipline serves the whole trace with caches that hold everything (a little under
    the ceiling: requests computing a shared prefix at once each compute it); loaded,
    the fewest-tokens-left order cuts TTFT p90 against admission order, and the bound
    keeps the longest wait finite."""
    trace = generate(sessions=8, turns=4, max_context=8000, seed=3)
    big = {"gpu_blocks": 10**6, "pool_objects": 10**6, "save_slots": None, "step_tokens": 1024}
    runs = {}
    for queue in ("fcfs", "cap", "srpf", "shortest"):
        m = Model(queue=queue, step_share=60.0, chunk_cap=256, aging_tokens=0.0, **big)
        r = simulate(trace, Policy("through", "client"), m)
        assert r.requests == trace.num_requests and r.steps > 0
        assert 0.95 * r.ceiling < (r.gpu + r.pool) / r.prompt <= r.ceiling
        runs[queue] = r
    assert runs["shortest"].quantiles()[1] < 0.7 * runs["fcfs"].quantiles()[1]
    with pytest.raises(ValueError, match="queue must be"):
        simulate(trace, Policy("through", "client"), Model(queue="lifo", **big))


def test_gates_serve_every_request_within_their_budgets() -> None:
    """The router's admission gate and decode's landing arena in front of the step model
    (benchmarks/pool_sim_gates.py): every request is served and every reservation given
    back (simulate asserts it); a tight decode KV budget makes requests wait at the gate
    and a larger one less; `late` reserves at the prefill's start, so nobody waits at the
    gate itself; a two-region arena makes requests wait for landing room."""
    trace = generate(sessions=8, turns=4, max_context=8000, seed=3)
    big = {
        "gpu_blocks": 10**6,
        "pool_objects": 10**6,
        "save_slots": None,
        "step_tokens": 1024,
        "queue": "shortest",
        "step_share": 20.0,
        "itl_s": 0.05,
        "handoff_s": 0.2,
        "landing_region_bytes": 64 * 2**20,
    }
    waits = {}
    for gate, kv_tokens in (("off", 5000), ("fifo", 5000), ("fits", 5000), ("fifo", 8000)):
        r = simulate(trace, Policy("through", "client"), Model(gate=gate, decode_kv_tokens=kv_tokens, **big))  # fmt: skip
        assert r.requests == trace.num_requests and r.gates is not None
        assert r.gates.max_reserved <= 0.9 * kv_tokens
        waits[gate, kv_tokens] = sum(r.gates.admission_s) / r.requests
    assert waits["off", 5000] == 0 < waits["fifo", 8000] < waits["fifo", 5000]
    assert waits["fits", 5000] < waits["fifo", 5000]
    late = simulate(trace, Policy("through", "client"), Model(gate="late", decode_kv_tokens=5000, **big))  # fmt: skip
    assert late.gates is not None and max(late.gates.admission_s) == 0
    assert 0 < late.gates.max_reserved <= 4500
    small = Model(gate="off", landing_bytes=2 * 64 * 2**20, **big)
    r = simulate(trace, Policy("through", "client"), small)
    assert r.gates is not None and max(r.gates.landing_s) > 0
    with pytest.raises(ValueError, match="gate must be"):
        simulate(trace, Policy("through", "client"), Model(gate="lifo", **big))


def test_gate_orders_pick_as_the_router_does() -> None:
    """fifo never passes the head; fits passes it with the first waiter that fits until
    the head has waited the bound; smallest takes the smallest that fits."""
    from benchmarks.pool_sim_gates import GateTimes, KVGate
    from benchmarks.pool_sim_queue import Job

    def job(seq: int, need: int, arrive: float) -> Job:
        j = Job(None, "k", 0, 0, seq, gate=GateTimes(arrive))  # type: ignore[arg-type]
        j.gate.need_tokens = need
        return j

    line = [job(0, 900, 0.0), job(1, 300, 0.1), job(2, 100, 0.2)]
    for order, now, want in (
        ("fifo", 0.5, None),
        ("fits", 0.5, 1),
        ("smallest", 0.5, 2),
        ("fits", 2.0, None),  # the head waited the bound: nobody passes it
    ):
        gate = KVGate(1000, order, bound_s=1.5)
        gate.reserved = 600
        gate.waiting = list(line)
        got = gate.next_to_go(now)
        assert (got.seq if got else None) == want, order

"""Routing policies and the admission gate on simulated instances (CPU logic only):
a ClusterView filled by hand with what the KV watcher would have learned."""

from __future__ import annotations

import asyncio
import random

import pytest

from protocol.hashing import chunk_keys, hash_chain, namespace_seed
from protocol.kv_events import KVEvent, KVEventBatch, WorkerInfo, WorkerLoad
from protocol.messages import PromptUsage
from router.admission import AdmissionGate, AdmissionSettings, TooManyRequests
from router.cluster_view import ClusterView
from router.errors import InvalidRequest
from router.instances import Instance
from router.kv_aware import KVAwarePolicy, SessionPolicy, pick_decode
from router.metrics import RouterMetrics
from router.policies import RouteContext, make_policy, policy_names

NS = "test-namespace"
ROOT = namespace_seed(NS)
BS, CS = 16, 256
BPT = 1000  # KV bytes per token


def _info(name: str, role: str = "prefill", capacity: int = 100_000) -> WorkerInfo:
    return WorkerInfo(
        name=name,
        role=role,
        namespace_key=NS,
        block_size=BS,
        chunk_size=CS,
        kv_bytes_per_token=BPT,
        kv_capacity_tokens=capacity,
    )


def _load(rate: float | None = 1000.0, restore: float | None = 1e8) -> WorkerLoad:
    return WorkerLoad(
        num_running=0,
        num_waiting=0,
        queued_tokens=0,
        kv_blocks_total=100,
        kv_blocks_free=100,
        compute_tokens_per_s=rate,
        restore_bytes_per_s=restore,
    )


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def _cluster(
    n: int, pools: dict[str, str | None] | None = None, **load: float | None
) -> tuple[ClusterView, list[Instance]]:
    insts = [Instance(f"p{i}", "prefill", f"http://p{i}") for i in range(n)]
    view = ClusterView(pool_of=pools or {})
    for i in insts:
        view.set_info(i, _info(i.name))
        view.apply_batch(i, KVEventBatch(epoch="e", next_seq=0, reset=True, load=_load(**load)))  # type: ignore[arg-type]
    return view, insts


def _store(view: ClusterView, inst: Instance, tokens: list[int]) -> None:
    st = view.state(inst)
    batch = KVEventBatch(
        epoch="e",
        next_seq=st.next_seq + 1,
        events=[KVEvent(st.next_seq, "stored", list(hash_chain(tokens, BS, ROOT)))],
        load=st.load or _load(),
    )
    view.apply_batch(inst, batch)


def _ctx(tokens: list[int], session: str | None = None, rid: str = "r") -> RouteContext:
    return RouteContext(rid, tokens, session_id=session)


def test_every_policy_is_registered() -> None:
    assert set(policy_names()) >= {"round_robin", "random", "session", "kv_aware"}
    view = ClusterView()
    for name in policy_names():
        assert make_policy(name, 0, view).name == name


def test_kv_aware_goes_where_the_prefix_is() -> None:
    view, insts = _cluster(2)
    history = _tokens(4000, 1)
    _store(view, insts[1], history)
    policy = KVAwarePolicy(0, view)
    prompt = history + _tokens(100, 2)
    assert policy.choose("prefill", _ctx(prompt), insts) is insts[1]
    price = policy.last_prices["p1"]
    assert price.gpu_tokens == 4000 and price.compute_tokens == len(prompt) - 4000
    assert policy.last_prices["p0"].gpu_tokens == 0


def test_kv_aware_leaves_a_busy_instance_when_recompute_is_cheaper() -> None:
    view, insts = _cluster(2)
    history = _tokens(1000, 3)
    _store(view, insts[0], history)
    # p0 already has 20K prompt tokens of work the router sent: 20 s at 1000 tok/s.
    view.on_prefill_sent(insts[0], "other", 20_000)
    policy = KVAwarePolicy(0, view)
    assert policy.choose("prefill", _ctx(history + [7] * 50), insts) is insts[1]
    view.on_prefill_done(insts[0], "other", [], None, None)
    assert policy.choose("prefill", _ctx(history + [7] * 50), insts) is insts[0]


def test_kv_aware_uses_measured_rates() -> None:
    view, insts = _cluster(2)
    prompt = _tokens(2000, 4)
    view.on_prefill_sent(insts[0], "a", 1000)
    view.on_prefill_sent(insts[1], "b", 1000)
    # p1 is measured 10x faster: the same queue costs it a tenth of the time.
    st = view.state(insts[1])
    st.load = _load(rate=10_000.0)
    assert KVAwarePolicy(0, view).choose("prefill", _ctx(prompt), insts) is insts[1]


def test_pool_hit_is_priced_with_restore_bandwidth() -> None:
    view, insts = _cluster(2, pools={"p0": "shared", "p1": None})
    history = _tokens(2048, 5)
    view.pools["shared"].add(chunk_keys(hash_chain(history, BS, ROOT), CS // BS))
    prompt = history + _tokens(100, 6)
    policy = KVAwarePolicy(0, view)
    assert policy.choose("prefill", _ctx(prompt), insts) is insts[0]
    assert policy.last_prices["p0"].pool_tokens == 2048
    assert policy.last_prices["p1"].pool_tokens == 0
    # A restore path slower than recomputing (1 KB/s): the pool hit is not worth it.
    view.state(insts[0]).load = _load(restore=1000.0)
    view.on_prefill_sent(insts[1], "x", 10)
    assert policy.choose("prefill", _ctx(prompt), insts) is insts[1]


def test_pool_removals_leave_the_router_index() -> None:
    """An instance saves a history (pool_saved), then its retention removes the tail
    (pool_removed): the router prices only the chunks still there."""
    view, insts = _cluster(1, pools={"p0": "shared"})
    history = _tokens(4 * CS, 8)
    keys = [bytes(k) for k in chunk_keys(hash_chain(history, BS, ROOT), CS // BS)]
    st = view.state(insts[0])

    def events(*evs: tuple[str, list[bytes]]) -> None:
        batch = KVEventBatch(
            epoch="e",
            next_seq=st.next_seq + len(evs),
            events=[KVEvent(st.next_seq + i, kind, h) for i, (kind, h) in enumerate(evs)],  # type: ignore[arg-type]
            load=st.load or _load(),
        )
        view.apply_batch(insts[0], batch)

    events(("pool_saved", keys))
    policy = KVAwarePolicy(0, view)
    prompt = history + _tokens(10, 9)
    policy.choose("prefill", _ctx(prompt), insts)
    assert policy.last_prices["p0"].pool_tokens == 4 * CS
    events(("pool_removed", keys[2:]))
    policy.choose("prefill", _ctx(prompt), insts)
    assert policy.last_prices["p0"].pool_tokens == 2 * CS
    assert len(view.pools["shared"]) == 2


def test_session_affinity_breaks_ties_only() -> None:
    view, insts = _cluster(2)
    policy = KVAwarePolicy(0, view)
    prompt = _tokens(500, 7)
    first = policy.choose("prefill", _ctx(prompt, "s1"), insts)
    # Equal prices: the session's instance wins every time.
    for _ in range(20):
        assert policy.choose("prefill", _ctx(_tokens(500, 8), "s1"), insts) is first
    # A clearly cheaper instance wins over affinity.
    other = insts[1] if first is insts[0] else insts[0]
    history = _tokens(3000, 9)
    _store(view, other, history)
    assert policy.choose("prefill", _ctx(history + [1] * 20, "s1"), insts) is other


def test_kv_aware_with_many_instances_keeps_the_prefix_holder_as_a_candidate() -> None:
    view, insts = _cluster(8)
    history = _tokens(2000, 10)
    _store(view, insts[5], history)
    policy = KVAwarePolicy(1, view)
    for i in range(30):
        assert policy.choose("prefill", _ctx(history + [i + 1] * 10), insts) is insts[5]


def test_prefill_done_records_what_the_instance_now_caches() -> None:
    view, insts = _cluster(2, pools={"p0": "shared", "p1": "shared"})
    prompt = _tokens(600, 11)
    chain = hash_chain(prompt, BS, ROOT)
    view.on_prefill_sent(insts[0], "r", 600)
    usage = PromptUsage(600, 0, 0, 600)
    view.on_prefill_done(insts[0], "r", prompt, chain, usage)
    assert view.state(insts[0]).outstanding_tokens == 0
    assert view.state(insts[0]).prefix.match_blocks(chain) == len(chain)
    # p0 reports no saves itself: its full chunks are taken as saved to its pool.
    assert view.pools["shared"].match_chunks(chunk_keys(chain, CS // BS)) == 2


def test_session_policy_sticks_and_falls_back() -> None:
    view, insts = _cluster(3)
    policy = SessionPolicy(0, view)
    a = policy.choose("prefill", _ctx([1] * 40, "a"), insts)
    assert all(policy.choose("prefill", _ctx([2] * 40, "a"), insts) is a for _ in range(5))
    rest = [i for i in insts if i is not a]
    b = policy.choose("prefill", _ctx([1] * 40, "a"), rest)  # a is unhealthy
    assert b in rest
    assert policy.choose("prefill", _ctx([1] * 40, "a"), insts) is b  # moved for good
    # Without a session: round robin over the candidates.
    seen = {policy.choose("prefill", _ctx([3] * 40), insts).name for _ in range(6)}
    assert seen == {"p0", "p1", "p2"}


def test_decode_choice_prefers_headroom_then_load() -> None:
    insts = [Instance(f"d{i}", "decode", f"http://d{i}") for i in range(2)]
    view = ClusterView()
    for i in insts:
        view.set_info(i, _info(i.name, "decode", capacity=10_000))
    view.state(insts[0]).reserved["x"] = 5000
    rng = random.Random(0)
    assert pick_decode(view, insts, rng) is insts[1]
    view.state(insts[1]).reserved["y"] = 5000
    view.state(insts[1]).reserved["z"] = 1
    assert pick_decode(view, insts, rng) is insts[0]


def _gate(capacity: int, **kw: float) -> tuple[AdmissionGate, list[Instance], RouterMetrics]:
    insts = [Instance("d0", "decode", "http://d0")]
    view = ClusterView()
    view.set_info(insts[0], _info("d0", "decode", capacity=capacity))
    metrics = RouterMetrics()
    return AdmissionGate(view, AdmissionSettings(**kw), metrics), insts, metrics  # type: ignore[arg-type]


def _value(metrics: RouterMetrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return v or 0.0


def test_gate_reserves_within_headroom_and_releases() -> None:
    async def run() -> None:
        gate, insts, _ = _gate(1000)
        pick = lambda room: room[0]  # noqa: E731
        a = await gate.admit("a", 600, lambda: insts, pick)
        # 600 + 300 = 900 <= 0.9 x 1000: admitted at once, no wait.
        b = await asyncio.wait_for(gate.admit("b", 300, lambda: insts, pick), 0.5)
        assert gate.view.state(insts[0]).reserved_tokens == 900
        a.release()
        a.release()  # idempotent
        b.release()
        assert gate.view.state(insts[0]).reserved_tokens == 0

    asyncio.run(run())


def test_gate_waits_then_admits_when_space_frees() -> None:
    async def run() -> None:
        gate, insts, metrics = _gate(1000, wait_timeout_s=5)
        pick = lambda room: room[0]  # noqa: E731
        a = await gate.admit("a", 800, lambda: insts, pick)
        waiter = asyncio.create_task(gate.admit("b", 500, lambda: insts, pick))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        assert _value(metrics, "kvserve_router_admission_waiting") == 1
        a.release()
        b = await asyncio.wait_for(waiter, 1)
        assert b.instance is insts[0]
        assert _value(metrics, "kvserve_router_admission_waiting") == 0

    asyncio.run(run())


def test_gate_times_out_with_429_and_retry_after() -> None:
    async def run() -> None:
        gate, insts, metrics = _gate(1000, wait_timeout_s=0.3)
        pick = lambda room: room[0]  # noqa: E731
        await gate.admit("a", 800, lambda: insts, pick)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TooManyRequests) as err:
            await gate.admit("b", 500, lambda: insts, pick)
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 1.5
        assert err.value.status == 429 and int(err.value.headers["retry-after"]) >= 1
        assert (
            _value(metrics, "kvserve_router_admission_rejections_total", reason="wait_timeout") == 1
        )

    asyncio.run(run())


def test_gate_rejects_at_once_when_the_queue_is_full_or_never_fits() -> None:
    async def run() -> None:
        gate, insts, metrics = _gate(1000, wait_timeout_s=5, max_waiting=1)
        pick = lambda room: room[0]  # noqa: E731
        await gate.admit("a", 800, lambda: insts, pick)
        waiter = asyncio.create_task(gate.admit("b", 500, lambda: insts, pick))
        await asyncio.sleep(0.05)
        with pytest.raises(TooManyRequests):
            await gate.admit("c", 10, lambda: insts, pick)  # FIFO: nobody jumps the queue
        assert (
            _value(metrics, "kvserve_router_admission_rejections_total", reason="queue_full") == 1
        )
        with pytest.raises(InvalidRequest):
            await gate.admit("d", 950, lambda: insts, pick)  # over the 900 budget: never
        waiter.cancel()

    asyncio.run(run())


def test_gate_does_not_block_on_unknown_capacity() -> None:
    async def run() -> None:
        gate = AdmissionGate(ClusterView(), AdmissionSettings())
        inst = Instance("d0", "decode", "http://d0")
        res = await asyncio.wait_for(
            gate.admit("a", 10**9, lambda: [inst], lambda room: room[0]), 0.5
        )
        assert res.instance is inst

    asyncio.run(run())

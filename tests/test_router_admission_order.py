"""The admission gate's order (router/admission_order.py) on a simulated decode instance:
fifo never lets anyone pass the head; fits_first lets a request that fits pass a head that
does not, until the head has waited pass_bound_s; nobody starves; every way out of the
line (admitted, 429, cancelled, no instance routable) leaves it and holds nothing."""

from __future__ import annotations

import asyncio

import pytest

from protocol.kv_events import WorkerInfo
from router.admission import AdmissionGate, AdmissionSettings, Reservation, TooManyRequests
from router.admission_order import FifoOrder, FitsFirstOrder, Waiter, make_order
from router.cluster_view import ClusterView
from router.errors import APIError, InvalidRequest, WorkerUnavailable
from router.instances import Instance
from router.metrics import RouterMetrics

INST = Instance("d0", "decode", "http://d0")


def _gate(order: str, capacity: int = 1000, **kw: float) -> AdmissionGate:
    view = ClusterView()
    view.set_info(
        INST,
        WorkerInfo(
            name="d0",
            role="decode",
            namespace_key="ns",
            block_size=16,
            chunk_size=256,
            kv_bytes_per_token=2,
            kv_capacity_tokens=capacity,
        ),
    )
    settings = AdmissionSettings(order=order, **kw)  # type: ignore[arg-type]
    return AdmissionGate(view, settings, RouterMetrics())


def _admit(gate: AdmissionGate, rid: str, tokens: int) -> asyncio.Task[Reservation]:
    return asyncio.create_task(gate.admit(rid, tokens, lambda: [INST], lambda room: room[0]))


def _reserved(gate: AdmissionGate) -> int:
    return gate.view.state(INST).reserved_tokens


def _waiting(gate: AdmissionGate) -> float:
    return gate.metrics.registry.get_sample_value("kvserve_router_admission_waiting") or 0.0


def test_orders_pick_from_the_line() -> None:
    def w(tokens: int, since: float, room: bool) -> Waiter:
        return Waiter(f"r{tokens}", tokens, since, lambda: room)

    big, small, other = w(500, 0.0, False), w(100, 0.1, True), w(50, 0.2, True)
    line = [big, small, other]
    assert FifoOrder().next_to_go(line, 0.5) is None  # the head does not fit: nobody
    assert FifoOrder().next_to_go([small, big], 0.5) is small
    assert not FifoOrder().lets_pass(line, 0.5) and FifoOrder().lets_pass([], 0.5)
    ff = FitsFirstOrder(pass_bound_s=1.0)
    assert ff.next_to_go(line, 0.5) is small  # the first that fits, in arrival order
    assert ff.lets_pass(line, 0.5)
    assert ff.next_to_go(line, 1.0) is None  # the head waited the bound: nobody passes
    assert not ff.lets_pass(line, 1.0)
    assert ff.next_to_go([w(500, 0.0, True), small], 5.0) is not small
    with pytest.raises(ValueError, match="fifo"):
        make_order("lifo", 1.0)


def test_fifo_holds_small_requests_behind_a_large_head() -> None:
    async def run() -> None:
        gate = _gate("fifo", wait_timeout_s=5)
        a = await _admit(gate, "a", 500)
        b = await _admit(gate, "b", 300)  # 800 of the 900 budget
        big = _admit(gate, "big", 500)
        await asyncio.sleep(0.05)
        small = _admit(gate, "small", 50)  # would fit (850) but the head waits
        await asyncio.sleep(0.1)
        assert not big.done() and not small.done() and _reserved(gate) == 800
        b.release()  # 500 reserved: big still does not fit, small does; fifo: nobody goes
        await asyncio.sleep(0.1)
        assert not big.done() and not small.done()
        a.release()
        (await big).release()
        (await small).release()
        assert _reserved(gate) == 0 and _waiting(gate) == 0

    asyncio.run(run())


def test_fits_first_passes_a_large_head_within_its_bound() -> None:
    async def run() -> None:
        gate = _gate("fits_first", wait_timeout_s=5, pass_bound_s=10)
        a = await _admit(gate, "a", 500)
        b = await _admit(gate, "b", 300)
        big = _admit(gate, "big", 500)
        mid = _admit(gate, "mid", 200)  # waits behind big: 1000 > 900
        await asyncio.sleep(0.05)
        small = await asyncio.wait_for(_admit(gate, "small", 50), 0.5)  # passes at once
        assert _reserved(gate) == 850 and not big.done() and not mid.done()
        b.release()  # 550: big (1050) does not fit, mid (750) does: mid passes big
        m = await asyncio.wait_for(mid, 1)
        assert not big.done() and _reserved(gate) == 750
        a.release()
        small.release()  # 200 reserved: big fits now
        g = await asyncio.wait_for(big, 1)
        assert _reserved(gate) == 700
        g.release()
        m.release()
        assert _reserved(gate) == 0 and _waiting(gate) == 0

    asyncio.run(run())


def test_fits_first_stops_passing_once_the_head_waited_the_bound() -> None:
    async def run() -> None:
        gate = _gate("fits_first", wait_timeout_s=5, pass_bound_s=0.2)
        a = await _admit(gate, "a", 800)
        big = _admit(gate, "big", 500)
        await asyncio.sleep(0.3)  # past the bound
        small = _admit(gate, "small", 50)  # fits (850) but may not pass an overdue head
        await asyncio.sleep(0.3)
        assert not big.done() and not small.done() and _reserved(gate) == 800
        a.release()
        g = await asyncio.wait_for(big, 1)
        s = await asyncio.wait_for(small, 1)
        g.release()
        s.release()
        assert _reserved(gate) == 0

    asyncio.run(run())


def test_fits_first_does_not_starve_a_large_request() -> None:
    """Small requests keep arriving and holding KV; under fits_first a large one that never
    fits beside them is admitted once it has waited the bound (they stop passing it), long
    before its wait times out."""

    async def run() -> None:
        gate = _gate("fits_first", wait_timeout_s=5, pass_bound_s=0.3)
        stop = asyncio.Event()
        smalls: list[asyncio.Task[None]] = []

        async def small_stream() -> None:
            i = 0
            while not stop.is_set():
                i += 1

                async def one(rid: str) -> None:
                    res = await gate.admit(rid, 300, lambda: [INST], lambda room: room[0])
                    await asyncio.sleep(0.15)
                    res.release()

                smalls.append(asyncio.create_task(one(f"s{i}")))
                await asyncio.sleep(0.05)

        stream = asyncio.create_task(small_stream())
        await asyncio.sleep(0.2)  # the small ones fill the budget (3 x 300 of 900)
        t0 = asyncio.get_running_loop().time()
        big = await asyncio.wait_for(gate.admit("big", 800, lambda: [INST], lambda r: r[0]), 3)
        waited = asyncio.get_running_loop().time() - t0
        assert 0.3 <= waited < 1.5, waited
        big.release()
        stop.set()
        await stream
        await asyncio.gather(*smalls)
        assert _reserved(gate) == 0 and _waiting(gate) == 0

    asyncio.run(run())


def test_every_way_out_of_the_line_holds_nothing() -> None:
    """429 after waiting (passed over or not), cancelled while waiting, no instance
    routable, 400 for a request no budget can hold: each leaves the line and reserves
    nothing; the status codes are those of fifo."""

    async def run() -> None:
        for order in ("fifo", "fits_first"):
            gate = _gate(order, wait_timeout_s=0.3, pass_bound_s=0.1, max_waiting=2)
            a = await _admit(gate, "a", 800)
            with pytest.raises(TooManyRequests) as err:
                await _admit(gate, "late", 500)
            assert err.value.status == 429 and int(err.value.headers["retry-after"]) >= 1
            assert _reserved(gate) == 800 and _waiting(gate) == 0
            waiting = _admit(gate, "w", 500)
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert _waiting(gate) == 0 and _reserved(gate) == 800

            def gone() -> list[Instance]:
                raise WorkerUnavailable("no healthy decode instance", code="no_healthy_instance")

            with pytest.raises(APIError) as unavailable:
                await gate.admit("x", 500, gone, lambda room: room[0])
            assert unavailable.value.status == 503 and _waiting(gate) == 0
            with pytest.raises(InvalidRequest):
                await _admit(gate, "huge", 950)  # over the 900 budget: 400, never waits
            # The line full (max_waiting 2): 429 at once.
            w1, w2 = _admit(gate, "w1", 500), _admit(gate, "w2", 400)
            await asyncio.sleep(0.05)
            with pytest.raises(TooManyRequests):
                await _admit(gate, "w3", 600)
            a.release()
            for t in (w1, w2):
                (await asyncio.wait_for(t, 1)).release()
            assert _reserved(gate) == 0 and _waiting(gate) == 0, order

    asyncio.run(run())

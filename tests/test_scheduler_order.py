"""The scheduler's prefill order (engine/prefill_order.py) on CPU logic only: a short
request overtakes a long running prefill, the bound keeps a long one from starving under
a stream of short ones, preemption picks a request not given tokens this step, connector
loads and the estimate of waiting requests, the `paused` set, and config validation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from scheduler_harness import apply_step, unique_request

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import ConnectorUpdate, KVConnectorScheduler, StepKV
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from protocol.ids import BlockId, RequestId

_req = unique_request


def _sched(
    kind: str, *, blocks: int = 256, budget: int = 10, seqs: int = 16, bound: int = 64
) -> Scheduler:
    return Scheduler(
        KVCacheManager(BlockPool(blocks), 4),
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        order=PrefillOrder(kind=kind, bound_steps=bound),
    )


def _given(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


@pytest.mark.parametrize("kind", ["fcfs", "shortest"])
def test_a_short_request_overtakes_a_long_running_prefill_only_when_shortest(kind: str) -> None:
    sched = _sched(kind)
    long = _req("long", 100)
    sched.add(long)
    apply_step(sched, sched.schedule())
    apply_step(sched, sched.schedule())  # 20 of 100 computed
    sched.add(_req("short", 5))
    out = sched.schedule()
    if kind == "shortest":  # the short one's whole prompt first, the rest to the long one
        assert _given(out) == [("short", 5), ("long", 5)]
        assert apply_step(sched, out) == ["short"] and long.num_output_tokens == 0
    else:  # behind the whole long prefill: 8 more steps before its first token
        assert _given(out) == [("long", 10)]
        steps = 1
        while "short" not in apply_step(sched, out):
            out = sched.schedule()
            steps += 1
        assert steps == 9


def test_the_bound_finishes_a_long_prompt_under_a_stream_of_short_ones() -> None:
    """Two 5-token requests arrive every step and would take the whole budget forever;
    the 40-token one goes first from `bound` steps after its arrival."""
    bound = 6

    def run(sched: Scheduler) -> int | None:
        long = _req("long", 40)
        sched.add(long)
        for step in range(1, 60):
            sched.add(_req(f"s{step}a", 5))
            sched.add(_req(f"s{step}b", 5))
            out = sched.schedule()
            if step < bound:  # under the bound the short ones go first
                assert all(rid != "long" for rid, _ in _given(out))
            if "long" in apply_step(sched, out):
                return step
        return None

    done = run(_sched("shortest", bound=bound))
    assert done is not None and done <= bound + 40 // 10  # the bound, then 4 whole steps
    assert run(_sched("shortest", bound=10**6)) is None  # no bound: starved


def test_preemption_picks_a_request_not_given_tokens_this_step() -> None:
    """The short request admitted last ranks first; when the long one needs a block that
    is not there, the victim is the long one itself (the short one already has its
    tokens), never a request already in the step."""
    sched = _sched("shortest", blocks=6, budget=8)
    long, short = _req("long", 16), _req("short", 6)
    sched.add(long)
    apply_step(sched, sched.schedule())  # long: 8 computed, 2 blocks
    sched.add(short)
    out = sched.schedule()  # short 6 (2 blocks), long 2 more (3rd block): 5 of 6 used
    assert _given(out) == [("short", 6), ("long", 2)]
    apply_step(sched, out, finish_sampled=False)  # short decodes on: its 7th token
    grow = _req("grow", 4)
    sched.add(grow)
    out = sched.schedule()
    # short decodes (1), grow (4) ranks before long (6 left); long needs a 4th block
    # and there is none: it is preempted, not short or grow.
    assert [r.request_id for r in out.preempted] == ["long"]
    assert _given(out) == [("short", 1), ("grow", 4)]
    assert long.status is RequestStatus.WAITING and long.num_computed_tokens == 0
    assert sched.waiting[0] is long
    # It comes back and finishes from its cached prefix once blocks free up.
    sched.finish(short, RequestStatus.FINISHED_STOPPED)
    apply_step(sched, out)
    for _ in range(4):
        if long.num_output_tokens:
            break
        apply_step(sched, sched.schedule())
    assert long.num_output_tokens == 1 and sched.counters.preemptions == 1


class _Loads(KVConnectorScheduler):
    """In-memory connector: `hits` tokens after the GPU prefix per request, loaded
    asynchronously; `pending` requests are still being looked up (None)."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits
        self.pending: set[str] = set()
        self.planned: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self.pending:
            return None, True
        return self.hits.get(request.request_id, 0), True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self.planned.append((request.request_id, num_external_tokens))

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return b""

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        return ConnectorUpdate()

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        return False


def test_waiting_requests_rank_by_what_the_connector_provides_and_load_off_budget() -> None:
    """`cold` (48 tokens) arrived first; `warm` (52 tokens, 48 in the pool) has 4 left
    and is admitted first, its load taking no budget; it then overtakes cold's prefill."""
    conn = _Loads({"warm": 48})
    sched = _sched("shortest", budget=8)
    sched.connector = conn
    cold, warm = _req("cold", 48), _req("warm", 52)
    sched.add(cold)
    sched.add(warm)
    out = sched.schedule()
    assert warm.status is RequestStatus.WAITING_FOR_KV and conn.planned == [("warm", 48)]
    assert _given(out) == [("cold", 8)]  # the load took no budget
    apply_step(sched, out)
    sched.update_from_connector(ConnectorUpdate(finished_loads={RequestId("warm"): 48}))
    assert warm.status is RequestStatus.RUNNING and warm.num_computed_tokens == 48
    out = sched.schedule()
    assert _given(out) == [("warm", 4), ("cold", 4)]
    assert apply_step(sched, out) == ["warm"]
    assert sched.counters.prompt_tokens_pool == 48 and sched.counters.loads_started == 1


def test_an_undecided_lookup_stays_waiting_in_place_and_others_go_on() -> None:
    conn = _Loads({})
    conn.pending.add("slow")
    sched = _sched("shortest", budget=20)
    sched.connector = conn
    slow, other = _req("slow", 4), _req("other", 8)
    sched.add(slow)
    sched.add(other)
    out = sched.schedule()
    assert _given(out) == [("other", 8)] and list(sched.waiting) == [slow]
    apply_step(sched, out)
    conn.pending.clear()
    assert _given(sched.schedule()) == [("slow", 4)]


def test_paused_requests_are_not_scheduled() -> None:
    sched = _sched("shortest", budget=20)
    a, b = _req("a", 6), _req("b", 10)
    sched.add(a)
    sched.add(b)
    apply_step(sched, sched.schedule(), finish_sampled=False)  # both prefilled, decoding
    sched.paused.add(a.request_id)  # its token is still on its way back (PP)
    assert _given(sched.schedule()) == [("b", 1)]


def test_the_order_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill order"):
        PrefillOrder(kind="lifo")
    with pytest.raises(ValueError, match="bound_steps"):
        PrefillOrder(bound_steps=0)
    with pytest.raises(ValueError, match="prefill order"):
        EngineConfig(prefill_order="random")
    assert EngineConfig().prefill_order == "shortest"

"""The admission rule (engine/admission.py) on CPU logic only: a burst of prompts larger
than the cache admitted whole (no preemption, nothing computed twice, no more steps) or
by chunk (preempted), blocks held for a handoff waited for, the shortest order still
passing a short prompt and its bound still starting a long one, a prompt that needs the whole cache, a prompt larger than the
cache admitted alone, and requests loading from a connector counted as admitted."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from scheduler_harness import apply_step, unique_request

from engine.admission import WholePromptAdmission, make_admission
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import ConnectorUpdate, KVConnectorScheduler, StepKV
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from protocol.ids import BlockId, RequestId

_req = unique_request


def _sched(admission: str, kind: str, *, blocks: int, budget: int) -> Scheduler:
    return Scheduler(
        KVCacheManager(BlockPool(blocks), 4),
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        order=PrefillOrder(kind=kind),
        admission=make_admission(admission),
    )


class _Connector(KVConnectorScheduler):
    """In-memory connector: the first `hits` tokens of a request, loaded asynchronously
    past its GPU prefix (done at the next `tick`); with `handoff_steps`, a finished request's blocks are held like a
    prefill instance's handoff to decode, one transfer after the other, each taking that
    many steps (released through `tick`)."""

    def __init__(self, hits: dict[str, int] | None = None, handoff_steps: int = 0) -> None:
        self.hits = hits or {}
        self.handoff_steps = handoff_steps
        self.step = 0
        self._release_at: dict[RequestId, int] = {}
        self._last_release = 0
        self._loads: dict[RequestId, int] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return max(0, self.hits.get(request.request_id, 0) - num_computed_tokens), True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self._loads[request.request_id] = num_external_tokens

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return b""

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        return ConnectorUpdate()

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        if not self.handoff_steps or request.status is RequestStatus.WAITING:
            return False  # preempted: nothing is sent
        at = max(self.step, self._last_release) + self.handoff_steps
        self._release_at[request.request_id], self._last_release = at, at
        return True

    def tick(self) -> ConnectorUpdate:
        """A step went by: the loads planned so far are done, due handoffs released."""
        self.step += 1
        done = {r for r, at in self._release_at.items() if at <= self.step}
        for r in done:
            del self._release_at[r]
        loads, self._loads = self._loads, {}
        return ConnectorUpdate(finished_loads=loads, released=done)


def _drain(sched: Scheduler, max_steps: int = 1000) -> tuple[int, int, list[str]]:
    """Step until every request left and its blocks came back: (steps, tokens computed,
    the order they left in)."""
    conn = sched.connector
    steps = tokens = 0
    done: list[str] = []
    while sched.has_work():
        assert steps < max_steps, "the scheduler made no progress"
        out = sched.schedule()
        steps += 1
        tokens += out.num_tokens
        done += apply_step(sched, out)
        if isinstance(conn, _Connector):
            sched.update_from_connector(conn.tick())
    return steps, tokens, done


@pytest.mark.parametrize("kind", ["fcfs", "shortest"])
def test_a_burst_larger_than_the_cache_is_admitted_whole_never_preempted(kind: str) -> None:
    """A prefill instance's cold start, scaled down: 32 prompts of 48..64 tokens (12..16
    blocks of 4) at once against 262 blocks (~19 prompts), a budget of 64 tokens, each
    finished prompt's blocks held for its handoff (4 steps, one after the other). chunk
    admits ahead of the returning blocks and preempts; whole_prompt computes every token
    once, in no more steps."""
    rng = random.Random(0)
    lens = [rng.randint(48, 64) for _ in range(32)]
    runs = {}
    for admission in ("chunk", "whole_prompt"):
        sched = _sched(admission, kind, blocks=262, budget=64)
        sched.connector = _Connector(handoff_steps=4)
        for i, n in enumerate(lens):
            sched.add(_req(f"r{i}", n))
        steps, tokens, done = _drain(sched)
        assert sorted(done) == sorted(f"r{i}" for i in range(32))
        assert sched.kv.pool.num_free_blocks == 262  # everything released
        runs[admission] = (steps, tokens, sched.counters)
    chunk, whole = runs["chunk"], runs["whole_prompt"]
    assert chunk[2].preemptions > 0 and chunk[2].recomputed_tokens > 0
    assert chunk[1] > sum(lens)  # work computed twice
    assert whole[2].preemptions == 0 and whole[2].recomputed_tokens == 0
    assert whole[1] == sum(lens)  # every prompt token once
    assert whole[0] <= chunk[0]
    assert whole[2].admissions_deferred > 0 and chunk[2].admissions_deferred == 0


def test_a_prompt_waits_for_held_blocks_rather_than_start_and_be_preempted() -> None:
    """Nothing runs but a finished prompt's blocks are on their way to decode: a prompt
    that fits only once they are back waits for them instead of starting alone."""
    sched = _sched("whole_prompt", "fcfs", blocks=16, budget=64)
    sched.connector = conn = _Connector(handoff_steps=3)
    sched.add(_req("first", 40))  # 10 blocks, held 3 steps after it finished
    apply_step(sched, sched.schedule())
    sched.update_from_connector(conn.tick())
    second = _req("second", 40)
    sched.add(second)
    out = sched.schedule()
    assert not out.scheduled and second.status is RequestStatus.WAITING
    _, _, done = _drain(sched)
    assert done == ["second"] and sched.counters.preemptions == 0


@pytest.mark.parametrize("kind", ["fcfs", "shortest"])
def test_shortest_still_passes_a_short_prompt_the_long_one_cannot_fit_beside(kind: str) -> None:
    """`a` runs with 12 of its 20 tokens (3 of its 5 blocks) to come; of 12 blocks, 10 are
    free: `long` (40 tokens, 10 blocks) does not fit beside it, `short` (8 tokens, 2
    blocks) does. Under shortest `short` goes first; under fcfs it waits behind `long` at
    the front of the queue (the head of line fcfs always had)."""
    sched = _sched("whole_prompt", kind, blocks=12, budget=8)
    sched.add(_req("a", 20))
    apply_step(sched, sched.schedule())
    sched.max_num_batched_tokens = 16
    sched.add(_req("long", 40))
    sched.add(_req("short", 8))
    out = sched.schedule()
    given = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    if kind == "shortest":
        assert given == [("short", 8), ("a", 8)]
    else:
        assert given == [("a", 12)] and [r.request_id for r in sched.waiting] == ["long", "short"]
    done = apply_step(sched, out) + _drain(sched)[2]
    assert sorted(done) == ["a", "long", "short"] and sched.counters.preemptions == 0


def test_the_bound_still_admits_a_long_prompt_under_a_stream_of_short_ones() -> None:
    """Two 8-token prompts arrive every step; the 60-token one (15 of 16 blocks) never
    fits beside them. Past the bound it ranks first: its refusal stops admission, the
    short ones drain, and it starts."""

    def run(bound: int) -> int | None:
        sched = Scheduler(
            KVCacheManager(BlockPool(16), 4),
            max_num_batched_tokens=16,
            max_num_seqs=16,
            order=PrefillOrder(kind="shortest", bound_steps=bound),
            admission=make_admission("whole_prompt"),
        )
        long = _req("long", 60)
        sched.add(long)
        sched.add(_req("s0a", 8))  # running before the long one is looked at
        apply_step(sched, sched.schedule())
        for step in range(1, 40):
            sched.add(_req(f"s{step}a", 8))
            sched.add(_req(f"s{step}b", 8))
            if "long" in apply_step(sched, sched.schedule()):
                assert sched.counters.preemptions == 0
                return step
        return None

    done = run(bound=6)
    assert done is not None and done <= 6 + 2 + 60 // 16  # bound, drain, its own steps
    assert run(bound=10**6) is None  # no bound: passed over for good


def test_a_prompt_that_needs_the_whole_cache_waits_then_finishes_alone() -> None:
    sched = _sched("whole_prompt", "shortest", blocks=16, budget=16)
    sched.add(_req("small", 20))
    apply_step(sched, sched.schedule())  # small: 16 of 20 computed, 5 blocks reserved
    whole = _req("whole", 64)  # 16 blocks: the whole cache
    sched.add(whole)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["small"]
    assert whole.status is RequestStatus.WAITING
    _, _, done = _drain(sched)
    assert done == ["small", "whole"] and sched.counters.preemptions == 0


def test_a_prompt_larger_than_the_cache_is_admitted_alone_as_with_chunk() -> None:
    """The engine refuses such a prompt (PromptTooLongError: tests/test_engine.py); the
    rule alone still lets it start when nothing else runs, as chunk does, rather than
    keep it waiting for blocks that do not exist."""
    for admission in ("chunk", "whole_prompt"):
        sched = _sched(admission, "fcfs", blocks=8, budget=16)
        big = _req("big", 40)  # 10 blocks of 8
        sched.add(big)
        out = sched.schedule()
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("big", 16)]


@pytest.mark.parametrize("admission", ["chunk", "whole_prompt"])
def test_a_loading_request_counts_as_admitted(admission: str) -> None:
    """`warm` (52 tokens, 48 from the connector) loads into 12 of 20 blocks and needs a
    13th for its last tokens; `cold` (40 tokens, 10 blocks) does not fit beside it: with
    whole_prompt it waits until warm left, with chunk it starts and one of them is
    preempted."""
    sched = _sched(admission, "fcfs", blocks=20, budget=8)
    sched.connector = conn = _Connector({"warm": 48})
    warm, cold = _req("warm", 52), _req("cold", 40)
    sched.add(warm)
    sched.add(cold)
    out = sched.schedule()
    assert warm.status is RequestStatus.WAITING_FOR_KV
    if admission == "whole_prompt":
        assert not out.scheduled and cold.status is RequestStatus.WAITING
    else:
        assert [s.request.request_id for s in out.scheduled] == ["cold"]
    apply_step(sched, out)
    sched.update_from_connector(conn.tick())  # warm's load is done: it runs
    assert warm.status is RequestStatus.RUNNING and warm.num_computed_tokens == 48
    _, _, done = _drain(sched)
    assert sorted(done) == ["cold", "warm"]
    assert warm.num_pool_prompt_tokens == 48
    if admission == "whole_prompt":
        assert done == ["warm", "cold"] and sched.counters.preemptions == 0
    else:
        assert sched.counters.preemptions > 0


def test_the_rule_is_validated_and_pure() -> None:
    with pytest.raises(ValueError, match="admission"):
        make_admission("eager")
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission="eager")
    assert EngineConfig().admission == "chunk"
    kv = KVCacheManager(BlockPool(4), 4)
    r = _req("r", 12)
    assert WholePromptAdmission().admits(kv, r, kv.find_prefix(r), [])
    assert kv.num_requests() == 0 and kv.pool.num_free_blocks == 4

"""Scheduler decisions on CPU logic only: budget, chunking, admission, preemption."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from protocol.hashing import namespace_seed
from protocol.ids import RequestId
from protocol.sampling import SamplingParams

ROOT = namespace_seed("test")


def _req(rid: str, n: int) -> Request:
    return Request(
        RequestId(rid),
        [sum(map(ord, rid)) % 50 + i for i in range(n)],
        SamplingParams(),
        block_size=4,
        hash_root=ROOT,
    )


def _apply(sched: Scheduler, out, sample_token: int = 7) -> None:
    """What the engine does after the model ran: advance progress, append samples."""
    for s in out.scheduled:
        samples = s.samples
        s.request.num_computed_tokens += s.num_new_tokens
        sched.kv.cache_full_blocks(s.request)
        if samples:
            s.request.append_output(sample_token, None)


def test_token_budget_chunks_long_prompt():
    sched = Scheduler(KVCacheManager(BlockPool(64), 4), max_num_batched_tokens=10, max_num_seqs=8)
    r = _req("a", 25)
    sched.add(r)
    chunks = []
    while r.num_output_tokens == 0:
        out = sched.schedule()
        chunks.append(out.num_tokens)
        _apply(sched, out)
    assert chunks == [10, 10, 5]


def test_decodes_first_then_admission_in_order():
    sched = Scheduler(KVCacheManager(BlockPool(64), 4), max_num_batched_tokens=8, max_num_seqs=8)
    a, b, c = _req("a", 3), _req("b", 6), _req("c", 6)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 5)]
    _apply(sched, out)
    out = sched.schedule()  # a decodes (1), b finishes its prompt (1), c gets the rest (6)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1),
        ("b", 1),
        ("c", 6),
    ]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(KVCacheManager(BlockPool(64), 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add(_req(f"r{i}", 4))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preempts_latest_and_recomputes():
    # 4 blocks of 4 tokens: two requests of 7 tokens fit (2 blocks each) until they grow.
    sched = Scheduler(KVCacheManager(BlockPool(4), 4), max_num_batched_tokens=100, max_num_seqs=8)
    a, b = _req("a", 7), _req("b", 7)
    sched.add(a)
    sched.add(b)
    _apply(sched, sched.schedule())  # both prefilled: 7 computed + 1 sampled each
    _apply(sched, sched.schedule())  # one decode each: 8 computed, 2 blocks each, full
    out = sched.schedule()  # a needs a third block: b (admitted last) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]  # outputs kept, recomputed later
    assert sched.waiting[0] is b
    assert sched.counters.preemptions == 1
    # a's third block evicted b's second (freed tail first, so taken first); b's first
    # is still cached: of the 8 tokens b had computed, 4 are computed again.
    _apply(sched, out)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 5)]
    assert b.num_computed_tokens == 4 and sched.counters.recomputed_tokens == 4


def test_finish_frees_blocks():
    kv = KVCacheManager(BlockPool(8), 4)
    sched = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    r = _req("a", 9)
    sched.add(r)
    _apply(sched, sched.schedule())
    assert kv.pool.num_free_blocks == 5
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == 8 and not sched.has_work()

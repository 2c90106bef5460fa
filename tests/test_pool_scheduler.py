"""PoolScheduler's aggregation over the stage processes of a PP prefill (CPU logic, the
"local" backend, reports written by hand as stage workers would): a load is done only
when every stage reported it, and counts the least of their runs; a finished request's
load is cancelled on every stage and its blocks released only after all of them; a chunk
counts as saved (metric, router event) only when every stage stored it; each stage's
counters land in the instance's series with its stage label."""

from __future__ import annotations

import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from engine.block_pool import BlockPool
from engine.kv_connector import StepKV
from engine.request import Request, RequestStatus
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.retention import LruChainRetention
from kvpool.stats import StageCounters
from prefill_worker.pool_connector import PoolScheduler
from protocol.hashing import namespace_seed
from protocol.ids import BlockId, ChunkKey, RequestId
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace
from protocol.pool_messages import PoolCounts, PoolLoadDone, PoolStepMeta, PoolWorkerReport
from protocol.sampling import SamplingParams

CHUNK = 256
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
NS = KVNamespace(
    weights_fingerprint="w", kv_dtype="float32", block_size=16, layer_split=(2, 2), rope="r"
)
_meta = msgspec.msgpack.Decoder(PoolStepMeta)


@pytest.fixture
def sched():
    backend = create_backend("local", BackendConfig("127.0.0.1", "local-sched-test"))
    client = PoolClient(
        backend,
        NS,
        LAYOUT,
        buffer_bytes=4 << 20,
        max_save_chunks=8,
        metrics=StageCounters(),
        local_stages=[0],
    )
    saved: list[list[ChunkKey]] = []
    s = PoolScheduler(
        client, PoolMetrics(CollectorRegistry(), "t"), 16, num_workers=2, on_saved=saved.append
    )
    yield s, saved
    s.close()
    client.close()


def _req(rid: str, n: int = 3 * CHUNK + 10) -> Request:
    return Request(
        RequestId(rid),
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=1),
        block_size=16,
        hash_root=namespace_seed(NS.key()),
    )


def _report(stage: int, **kw) -> bytes:  # type: ignore[no-untyped-def]
    return msgspec.msgpack.encode(PoolWorkerReport([stage], **kw))


def _count(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


def test_load_done_when_every_stage_reported_with_the_least_run(sched):
    s, _ = sched
    r = _req("r")
    r.num_computed_tokens = 0
    s.update_state_after_alloc(r, [BlockId(b) for b in range(49)], 3 * CHUNK)
    meta = _meta.decode(s.build_step_meta([]))
    assert [ld.request_id for ld in meta.loads] == ["r"] and len(meta.loads[0].chunk_keys) == 3
    assert s.has_pending()
    got = s.update_from_workers([_report(0, loads=[PoolLoadDone("r", 3 * CHUNK)]), b""])
    assert got.finished_loads == {}  # stage 1 has not reported yet
    got = s.update_from_workers([b"", _report(1, loads=[PoolLoadDone("r", CHUNK)])])
    assert got.finished_loads == {"r": CHUNK}  # stage 1 verified only the first chunk
    assert not s.has_pending()
    assert _count(s.metrics.restored_tokens) == CHUNK


def test_finished_while_loading_cancels_everywhere_and_releases_after_all(sched):
    s, _ = sched
    r = _req("r")
    r.num_computed_tokens = 0
    s.update_state_after_alloc(r, [BlockId(b) for b in range(49)], 2 * CHUNK)
    s.build_step_meta([])
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, [BlockId(0)]) is True  # the loads may still write
    assert _meta.decode(s.build_step_meta([])).cancels == ["r"]
    assert s.update_from_workers([_report(0, loads=[PoolLoadDone("r", 0)]), b""]).released == set()
    got = s.update_from_workers([b"", _report(1, loads=[PoolLoadDone("r", 0)])])
    assert got.released == {"r"} and got.finished_loads == {}


def test_chunk_saved_only_when_every_stage_stored_it(sched):
    s, saved = sched
    r = _req("r")
    meta = _meta.decode(
        s.build_step_meta([StepKV(r, 0, r.num_prompt_tokens, [BlockId(b) for b in range(49)])])
    )
    keys = meta.saves[0].chunk_keys
    assert len(keys) == 3 and [len(b) for b in meta.saves[0].block_ids] == [16, 16, 16]
    s.update_from_workers([_report(0, saved=keys), _report(1, saved=keys[:2], unsaved=keys[2:])])
    assert saved == [[ChunkKey(k) for k in keys[:2]]]  # chunk 2 is only on stage 0
    assert _count(s.metrics.save_chunks) == 2 and not s.has_pending()
    # The next step of the same request saves nothing again.
    assert s.build_step_meta([StepKV(r, r.num_prompt_tokens, r.num_prompt_tokens + 1, [])]) == b""


def test_a_failed_forwards_chunks_are_never_saved(sched):
    """A request whose forward failed (engine/step_isolation.py): its saves leave the
    step's metadata, no report of them is awaited, the other request's stay."""
    s, saved = sched
    bad, good = _req("bad"), _req("good", 2 * CHUNK + 3)
    blocks = [BlockId(b) for b in range(49)]
    raw = s.build_step_meta(
        [
            StepKV(bad, 0, bad.num_prompt_tokens, blocks),
            StepKV(good, 0, good.num_prompt_tokens, blocks),
        ]
    )
    assert s.has_pending()
    meta = _meta.decode(s.without_requests(raw, {"bad"}))
    assert [x.request_id for x in meta.saves] == ["good"]
    keys = meta.saves[0].chunk_keys
    s.update_from_workers([_report(0, saved=keys), _report(1, saved=keys)])
    assert saved == [[ChunkKey(k) for k in keys]] and not s.has_pending()
    assert s.without_requests(s.build_step_meta([]), {"bad"}) == b""


def test_stage_counters_land_in_the_instance_series(sched):
    s, _ = sched
    counts = [
        PoolCounts(load_bytes=10, restore_seconds=[(st, 0.01)], saved_objects=[(st, 3)])
        for st in (0, 1)
    ]
    s.update_from_workers([_report(0, counts=counts[0]), _report(1, counts=counts[1])])
    m = s.metrics
    assert _count(m.load_bytes) == 20
    for st in ("0", "1"):
        assert _count(m.stage_objects_total, instance="t", stage=st, op="save") == 3
        assert m.restore_seconds.labels(instance="t", stage=st)._sum.get() == pytest.approx(0.01)


def test_lookup_answer_reused_while_fresh_and_prefix_grows(sched):
    s, _ = sched
    r = _req("r")
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)  # asked on the lookup thread
    deadline = time.monotonic() + 5
    while s.has_pending():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    asked = _count(s.metrics.lookups_i) + s.client.metrics.drain().lookups
    assert s.get_num_new_matched_tokens(r, 0) == (0, True)  # the pool is empty
    # Waiting for blocks: asked again next step (its GPU prefix grew by one chunk): the
    # fresh answer serves, no new lookup.
    assert s.get_num_new_matched_tokens(r, CHUNK) == (0, True)
    assert s.client.metrics.drain().lookups == 0 and asked == 1
    s.update_state_after_alloc(r, [], 0)  # admitted: the answer is dropped
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)


# -- chunks waiting for a save slot (prefill_worker/pool_save_queue.py) ------------------------
@pytest.fixture
def tight():
    """Two save slots per stage process, two stage processes, the engine's block pool."""
    backend = create_backend("local", BackendConfig("127.0.0.1", "local-tight-test"))
    client = PoolClient(
        backend,
        NS,
        LAYOUT,
        buffer_bytes=4 << 20,
        max_save_chunks=2,
        metrics=StageCounters(),
        local_stages=[0],
    )
    saved: list[list[ChunkKey]] = []
    s = PoolScheduler(
        client, PoolMetrics(CollectorRegistry(), "t"), 16, num_workers=2, on_saved=saved.append
    )
    pool = BlockPool(256)
    s.bind_block_pool(pool)
    yield s, saved, pool
    s.close()
    client.close()


def _computed(pool: BlockPool, r: Request) -> list[BlockId]:
    """r's prompt computed into fresh blocks of `pool`, its full blocks cached."""
    blocks = pool.allocate(-(-r.num_prompt_tokens // 16))
    assert blocks is not None
    for b, h in zip(blocks, r.block_hashes, strict=False):
        pool.cache_block(b, h)
    return blocks


def _both_store(s: PoolScheduler, meta: PoolStepMeta) -> None:
    keys = [k for save in meta.saves for k in save.chunk_keys]
    s.update_from_workers([_report(0, saved=keys), _report(1, saved=keys)])


def test_chunks_wait_for_a_slot_in_chain_order_and_none_is_dropped(tight):
    s, saved, pool = tight
    r = _req("r", 6 * CHUNK + 10)
    blocks = _computed(pool, r)
    meta = _meta.decode(s.build_step_meta([StepKV(r, 0, r.num_prompt_tokens, blocks)]))
    want = [bytes(k) for k in s._keys(r, 0, 6)]
    assert [k for x in meta.saves for k in x.chunk_keys] == want[:2]  # two slots
    assert _count(s.metrics.save_deferred) == 4 and s.has_pending()
    assert s.build_step_meta([]) == b""  # no worker reported: no slot is free
    s.update_from_workers([_report(0, saved=want[:2]), b""])
    assert s.build_step_meta([]) == b""  # every worker needs a slot for it
    s.update_from_workers([b"", _report(1, saved=want[:1])])
    meta = _meta.decode(s.build_step_meta([]))
    assert meta.saves[0].chunk_keys == want[2:3]
    assert meta.saves[0].block_ids == [[int(b) for b in blocks[32:48]]]
    s.update_from_workers([b"", _report(1, saved=want[1:2])])
    _both_store(s, meta)
    for _ in range(10):
        raw = s.build_step_meta([])
        if raw:
            _both_store(s, _meta.decode(raw))
    assert not s.has_pending()
    assert [k for batch in saved for k in batch] == [ChunkKey(k) for k in want]
    assert _count(s.metrics.save_dropped) == 0
    assert _count(s.metrics.save_lost, instance="t", reason="evicted") == 0


def test_a_finished_requests_chunks_are_saved_from_the_prefix_cache_until_evicted(tight):
    """The request finishes with four chunks waiting: they are packed from whichever
    blocks hold their hashes now; once the cache reuses a chunk's blocks it is lost and
    the chunks after it never take a slot."""
    s, saved, pool = tight
    r = _req("r", 6 * CHUNK + 10)
    blocks = _computed(pool, r)
    meta = _meta.decode(s.build_step_meta([StepKV(r, 0, r.num_prompt_tokens, blocks)]))
    r.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(r, blocks) is False
    pool.free(blocks[::-1])  # cached free: the content stays until reused
    _both_store(s, meta)
    meta = _meta.decode(s.build_step_meta([]))
    assert meta.saves[0].block_ids == [
        [int(b) for b in blocks[c * 16 : (c + 1) * 16]] for c in (2, 3)
    ]
    # The cache reuses the least recently freed blocks: the tail, chunk 5, then chunk 4.
    assert pool.allocate(pool.num_free_blocks - 4 * 16 - 16 + 8) is not None
    assert pool.lookup(r.block_hashes[4 * 16 + 15]) is None  # chunk 4 lost a block
    _both_store(s, meta)
    assert s.build_step_meta([]) == b""
    assert _count(s.metrics.save_lost, instance="t", reason="evicted") == 1
    assert _count(s.metrics.save_lost, instance="t", reason="chain") == 1
    assert not s.has_pending()
    assert [k for batch in saved for k in batch] == [ChunkKey(k) for k in s._keys(r, 0, 4)]


def test_a_chunk_no_worker_stored_drops_the_rest_of_its_chain(tight):
    s, saved, pool = tight
    r = _req("r", 5 * CHUNK + 10)
    blocks = _computed(pool, r)
    meta = _meta.decode(s.build_step_meta([StepKV(r, 0, r.num_prompt_tokens, blocks)]))
    keys = meta.saves[0].chunk_keys
    s.update_from_workers(
        [_report(0, saved=keys), _report(1, saved=keys[:1], unsaved=keys[1:])]
    )  # chunk 1 is a hole: chunks 2-4 could never be a hit
    assert s.build_step_meta([]) == b"" and not s.has_pending()
    assert _count(s.metrics.save_lost, instance="t", reason="chain") == 3
    assert saved == [[ChunkKey(keys[0])]]


def test_retention_removals_are_published(tight):
    """What retention removes is announced (on_removed -> pool_removed KV events), so
    the router's pool index stops counting it; the removal itself runs on the lookup
    thread."""
    _, _, pool = tight
    backend = create_backend("local", BackendConfig("127.0.0.1", "local-removed-test"))
    client = PoolClient(
        backend,
        NS,
        LAYOUT,
        buffer_bytes=4 << 20,
        max_save_chunks=8,
        metrics=StageCounters(),
        local_stages=[0],
    )
    removed: list[list[ChunkKey]] = []
    s = PoolScheduler(
        client,
        PoolMetrics(CollectorRegistry(), "t"),
        16,
        num_workers=2,
        on_removed=removed.append,
        retention=LruChainRetention(2, protect_s=0.0, low_water=1.0),
    )
    try:
        r = _req("r", 3 * CHUNK + 10)
        _both_store(
            s,
            _meta.decode(
                s.build_step_meta([StepKV(r, 0, r.num_prompt_tokens, _computed(pool, r))])
            ),
        )
        assert removed == [[ChunkKey(bytes(s._keys(r, 2, 3)[0]))]]  # the tail goes first
        assert _count(s.metrics.retention_removed) == 1
    finally:
        s.close()
        client.close()

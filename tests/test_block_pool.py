"""BlockPool and KVCacheManager invariants, on CPU logic only."""

from __future__ import annotations

import random

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from protocol.hashing import namespace_seed
from protocol.ids import BlockHash, BlockId, RequestId
from protocol.sampling import SamplingParams

ROOT = namespace_seed("test")


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(RequestId(rid), tokens, SamplingParams(), block_size=4, hash_root=ROOT)


def _check_invariants(pool: BlockPool) -> None:
    free = set(pool._free)
    for b in range(pool.num_blocks):
        assert (pool.ref_cnt(BlockId(b)) == 0) == (b in free)
    for h, b in pool._cached.items():
        assert pool.block_hash(b) == h


def test_allocate_free_and_lru_eviction():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    for b, h in zip(a, (b"h0", b"h1", b"h2"), strict=True):
        pool.cache_block(b, BlockHash(h))
    pool.free(a[::-1])  # tail first: block 2 is evicted first
    assert pool.allocate(5) is None  # short: nothing changes
    got = pool.allocate(2)
    assert got == [3, 2]
    assert pool.lookup(BlockHash(b"h2")) is None and pool.num_evictions == 1
    assert pool.lookup(BlockHash(b"h0")) == 0
    _check_invariants(pool)


def test_touch_revives_cached_free_block():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, BlockHash(b"x"))
    pool.free([b])
    assert pool.num_free_blocks == 2
    pool.touch([b])
    assert pool.ref_cnt(b) == 1 and pool.num_free_blocks == 1
    _check_invariants(pool)


def test_duplicate_content_keeps_first_block():
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, BlockHash(b"same"))
    pool.cache_block(b1, BlockHash(b"same"))
    assert pool.lookup(BlockHash(b"same")) == b0 and pool.block_hash(b1) is None


def test_manager_prefix_hit_and_accounting():
    kv = KVCacheManager(BlockPool(16), block_size=4)
    r1 = _req("a", list(range(10)))
    assert kv.allocate_slots(r1, 10)
    r1.num_computed_tokens = 10
    kv.cache_full_blocks(r1)  # blocks 0, 1 full
    r2 = _req("b", [*range(8), 99, 98, 97])
    hit = kv.find_prefix(r2)
    assert hit.num_tokens == 8 and hit.block_ids == kv.block_table(r1.request_id)[:2]
    assert kv.allocate_slots(r2, 3, hit)
    assert kv.pool.ref_cnt(hit.block_ids[0]) == 2
    kv.free(r1)
    kv.free(r2)
    assert kv.pool.num_free_blocks == 16
    _check_invariants(kv.pool)


def test_randomized_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(BlockPool(32), block_size=4)
    live: list[Request] = []
    base = list(range(40))
    for i in range(400):
        if live and rng.random() < 0.4:
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
        else:
            n = rng.randrange(1, 40)
            r = _req(f"r{i}", base[: rng.randrange(0, 20)] + [rng.randrange(100) for _ in range(n)])
            hit = kv.find_prefix(r)
            if kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit):
                r.num_computed_tokens = r.num_tokens
                kv.cache_full_blocks(r)
                live.append(r)
        _check_invariants(kv.pool)
        held = sum(len(kv.block_table(r.request_id)) for r in live)
        assert sum(kv.pool.ref_cnt(BlockId(b)) for b in range(32)) == held


def test_eviction_listener_hears_evicted_blocks_before_they_are_handed_out():
    pool = BlockPool(4)
    heard: list[list[tuple[BlockId, BlockHash]]] = []
    pool.on_evict = lambda pairs: heard.append([(b, h) for b, h in pairs if pool.ref_cnt(b) == 1])
    blocks = pool.allocate(3)
    assert blocks is not None and heard == []  # fresh blocks: nothing evicted
    for i, b in enumerate(blocks):
        pool.cache_block(b, BlockHash(bytes([i]) * 16))
    pool.free(blocks[::-1])  # cached free, tail first
    got = pool.allocate(3)  # the never-used block, then the tail's two
    assert got == [BlockId(3), blocks[2], blocks[1]]
    assert heard == [[(blocks[2], BlockHash(b"\x02" * 16)), (blocks[1], BlockHash(b"\x01" * 16))]]
    assert pool.lookup(BlockHash(b"\x00" * 16)) == blocks[0]  # not evicted: still a hit

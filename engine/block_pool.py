"""BlockPool: the physical KV blocks of one cache, their ref counts and the prefix cache.

    blocks:        [0] [1] [2] [3] [4] [5] ...      ref_cnt per block
    free queue:    LRU order of blocks with ref_cnt == 0  (front = evicted first)
    cached_blocks: BlockHash -> BlockId for full blocks whose content is known

A free block may still carry a hash: it is "cached free" and can be revived by a prefix
hit (`touch`) until `allocate` pops it from the front of the free queue, which evicts its
hash. Invariants: a block is in the free queue iff its ref_cnt is 0; a hash maps to at most
one block and that block carries that hash.

Eviction listener (`on_evict`, a KV connector that saves what the cache evicts): told the
(block, hash) pairs `allocate` evicts, before it returns them. Their content is intact
until the forward of the step that allocated them writes into them, so a save queued
before that forward (KVConnectorWorker.start_loads, in stream order) reads the evicted
KV. Allocation therefore happens only while a step is scheduled (engine/scheduler.py),
or with no listener (the engine's decode-ahead checks the connector).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from protocol.ids import BlockHash, BlockId


@dataclass
class BlockPoolEvent:
    """A change of the prefix cache's contents, for KV-aware routing (stored or removed)."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[BlockHash]


class BlockPool:
    """Owns the ref counts, LRU free queue and hash map of `num_blocks` KV blocks."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (BlockId(i), None) for i in range(num_blocks)
        )
        self._cached: dict[BlockHash, BlockId] = {}
        self.num_evictions = 0
        self.events: list[BlockPoolEvent] = []
        self.record_events = False
        self.on_evict: Callable[[list[tuple[BlockId, BlockHash]]], None] | None = None
        """Told what each allocate evicts, before the blocks are handed out (module doc)."""

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_cnt(self, block_id: BlockId) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._hash[block_id]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (a snapshot for KV-event consumers)."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        """The block holding this content, or None (a miss is an ordinary outcome)."""
        return self._cached.get(block_hash) if self.enable_caching else None

    # -- mutations ---------------------------------------------------------------------
    def allocate(self, num: int) -> list[BlockId] | None:
        """Take `num` blocks (ref_cnt 1), evicting the least recently freed; None if short."""
        if num > len(self._free):
            return None
        out: list[BlockId] = []
        removed: list[BlockHash] = []
        evicted: list[tuple[BlockId, BlockHash]] = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            h = self._hash[block_id]
            if h is not None:
                del self._cached[h]
                self._hash[block_id] = None
                self.num_evictions += 1
                removed.append(h)
                evicted.append((block_id, h))
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        if removed and self.record_events:
            self.events.append(BlockPoolEvent("removed", removed))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def touch(self, block_ids: Iterable[BlockId]) -> None:
        """Take one more reference on each block (a prefix hit), reviving cached free ones."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference on each block, in the given order of eviction priority.

        Callers pass a request's blocks tail-first so that its prefix, the part most likely
        to be shared, is evicted last.
        """
        for b in block_ids:
            assert self._ref_cnt[b] > 0, f"double free of block {b}"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None

    def cache_block(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """Register a full, computed block's content. A hash already held by another block
        (the same content computed twice concurrently) keeps its first block."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            self.events.append(BlockPoolEvent("stored", [block_hash]))

    def uncache(self, block_ids: Iterable[BlockId]) -> list[BlockHash]:
        """Forget the content of these blocks (their KV turned out not to be valid: a
        pipeline caches a step's blocks when it issues the step, before a later stage
        could fail it). Returns the hashes dropped."""
        removed: list[BlockHash] = []
        for b in block_ids:
            h = self._hash[b]
            if h is not None and self._cached.get(h) == b:
                del self._cached[h]
                removed.append(h)
            self._hash[b] = None
        if removed and self.record_events:
            self.events.append(BlockPoolEvent("removed", removed))
        return removed

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data but lose their identity).
        Returns how many hashes were dropped."""
        n = len(self._cached)
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()
        if self.record_events:
            self.events.append(BlockPoolEvent("cleared", []))
        return n

    def drain_events(self) -> list[BlockPoolEvent]:
        out, self.events = self.events, []
        return out

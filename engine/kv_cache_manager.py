r"""KVCacheManager: which blocks each request holds, prefix hits, and slot allocation.

A request's block table covers its tokens in order:

    tokens:       0 ....... 15 | 16 ...... 31 | 32 .. 40 (partial)
    block table:  [   b7      ,     b2       ,    b9    ]
                  \_ cached (hash registered) _/ \_ not yet full _/

`allocate_slots` grows the table to hold num_computed_tokens + num_new_tokens; blocks
become cached once they are full and computed (`cache_full_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.request import Request
from protocol.ids import BlockId, RequestId


@dataclass
class PrefixHit:
    """Blocks of a request's prefix found in the cache, and the tokens they cover."""

    block_ids: list[BlockId]
    num_tokens: int


class KVCacheManager:
    """Owns the mapping request -> block table over one BlockPool."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[RequestId, list[BlockId]] = {}
        self._num_cached: dict[RequestId, int] = {}

    def block_table(self, request_id: RequestId) -> list[BlockId]:
        return self._tables.get(request_id, [])

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of the request's full blocks already cached.

        At least one token is always left to compute: its logits are needed to sample.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[BlockId] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return PrefixHit(hit, len(hit) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones (after `prefix` when given,
        for a request being admitted). False, with nothing changed, when blocks are short."""
        table = self._tables.setdefault(request.request_id, [])
        hit = prefix.block_ids if prefix else []
        num_computed = prefix.num_tokens if prefix else request.num_computed_tokens
        num_new_blocks = self._num_blocks_for(num_computed + num_new_tokens) - len(table) - len(hit)
        if num_new_blocks + self._num_revived(hit) > self.pool.num_free_blocks:
            if not table:
                del self._tables[request.request_id]
            return False
        if hit:
            self.pool.touch(hit)
            table.extend(hit)
            self._num_cached[request.request_id] = len(hit)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            assert new is not None
            table.extend(new)
        return True

    def num_blocks_short(
        self, request: Request, num_tokens: int, prefix: PrefixHit | None = None
    ) -> int:
        """Free blocks the request would take to hold `num_tokens` tokens: the blocks its
        table (or, being admitted, its `prefix` hit) lacks, plus the hit's cached free blocks
        a revival takes out of the free queue. Mutates nothing."""
        hit = prefix.block_ids if prefix else []
        num_held = len(self._tables.get(request.request_id, [])) + len(hit)
        num_new_blocks = max(0, self._num_blocks_for(num_tokens) - num_held)
        return num_new_blocks + self._num_revived(hit)

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_revived(self, hit: list[BlockId]) -> int:
        """Reviving a cached free block takes it out of the free queue too."""
        return sum(1 for b in hit if self.pool.ref_cnt(b) == 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        done = self._num_cached.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(done, num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(done, num_full)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (the prefix is evicted last)."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            self.pool.free(table[::-1])

    def detach(self, request: Request) -> list[BlockId]:
        """Take the request's table out of the manager without freeing its blocks (a KV
        connector still uses them; `free_table` frees them later)."""
        self._num_cached.pop(request.request_id, None)
        return self._tables.pop(request.request_id, [])

    def free_table(self, table: list[BlockId]) -> None:
        """Free blocks of a detached table, tail first."""
        if table:
            self.pool.free(table[::-1])

    def num_requests(self) -> int:
        return len(self._tables)

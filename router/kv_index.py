"""The router's picture of where KV lives: per prefill instance its GPU prefix cache, per
pool the chunks it holds. Both are hints for pricing, never a correctness input: the
instance decides what it really reuses and reports it in PromptUsage.

    PrefixIndex (one per prefill instance)   block hashes, from the worker's KV events
    PoolIndex   (one per pool)               chunk keys, LRU with the pool's capacity

Pool residency is tracked, not asked: a Mooncake existence check grants a read lease that
blocks eviction for 10 s (MOONCAKE.md §1.3, §1.6), so a router that asked the pool about
every request would pin it. Chunks enter the index when a prefill instance reports it
saved them (`pool_saved` events) or, for instances that do not report saves, when a
request that instance prefilled ends (its full chunks are what it saves). They leave it
when that instance's retention removes them (`pool_removed` events, pool.retention:
client) or by LRU once the index holds the pool's estimated capacity (Mooncake evicts
at its high watermark), so the router's view drifts from the pool's only by Mooncake's
own eviction order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from protocol.ids import BlockHash


def leading_run(hashes: Sequence[bytes], present: set[bytes] | OrderedDict[bytes, None]) -> int:
    """How many of `hashes`, from the first, are all in `present`."""
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


class PrefixIndex:
    """Block hashes one prefill instance has cached on its GPU (its BlockPool)."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()

    def reset(self, snapshot: Iterable[bytes]) -> None:
        self.blocks = set(snapshot)

    def apply(self, kind: str, hashes: Iterable[bytes]) -> None:
        """One KV event (protocol/kv_events.py); pool_saved is not about this cache."""
        if kind == "stored":
            self.blocks.update(hashes)
        elif kind == "removed":
            self.blocks.difference_update(hashes)
        elif kind == "cleared":
            self.blocks.clear()

    def match_blocks(self, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of a request's hash chain this instance holds."""
        return leading_run(chain, self.blocks)


class PoolIndex:
    """Chunk keys one pool holds, as far as the router can tell (see the module doc).

    `capacity_chunks` None: unbounded (capacity unknown)."""

    def __init__(self, capacity_chunks: int | None = None) -> None:
        self.capacity_chunks = capacity_chunks
        self._chunks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, keys: Iterable[bytes]) -> None:
        """Saved (or re-read, which refreshes LRU): most recent last."""
        for k in keys:
            self._chunks[k] = None
            self._chunks.move_to_end(k)
        if self.capacity_chunks is not None:
            while len(self._chunks) > self.capacity_chunks:
                self._chunks.popitem(last=False)

    def remove(self, keys: Iterable[bytes]) -> None:
        """Removed from the pool by the instance that saved them (its retention)."""
        for k in keys:
            self._chunks.pop(k, None)

    def match_chunks(self, keys: Sequence[bytes]) -> int:
        """Leading chunks of a request the pool holds (keys: protocol.hashing.chunk_keys)."""
        return leading_run(keys, self._chunks)

    def clear(self) -> None:
        self._chunks.clear()

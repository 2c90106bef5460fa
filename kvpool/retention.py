"""Retention: which of its chunks a pool client removes itself, before Mooncake evicts.

    "mooncake"  nothing here: the master evicts when the pool passes its high watermark
                (0.9), ~5% of the OBJECTS per pass, shard by shard over 1024 hash shards,
                each shard its own oldest-leased objects first (never-read ones are the
                oldest). With a few thousand 32 MiB chunks that is ~2 objects a shard:
                close to random eviction, and one hole in a session's chain loses every
                chunk behind it (a hit is a leading run).
    "client"    LruChainRetention: the client keeps the chunks it saved within a budget
                (its share of the pool, under the watermark, so the master never has to
                evict), removing the least recently used chains first and, within one
                use, the deepest chunk first, so a chain shrinks from its tail and keeps
                a usable prefix:

        use stamps      s0 (old)               s1                 s2 (new)
        chains          A0 A1 A2 A3            B0 B1 B2           C0 C1 C2 C3 C4
        removal order   4  3  2  1   then      7  6  5   then     ...

Recency is per request, not per chunk: every chunk a request uses (its prefix, restored
from the GPU cache or the pool, and the chunks it saves) gets the stamp of the request's
first lookup, so one chain's chunks never age apart (a later save of the same request
would otherwise make its prefix look older than its tail). benchmarks/pool_policy_sim.py
compares the two on the agentic trace. Engine thread only (PoolScheduler).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

from protocol.ids import ChunkKey

PROTECT_S = 10.0
"""A chunk used this recently is never removed: a load planned from a lookup may still be
reading it (Mooncake's read lease is 10 s by default)."""


class Retention:
    """The "mooncake" policy: the client removes nothing (the master evicts). Also the
    interface: every method is called on the engine thread and returns at once."""

    name = "mooncake"

    def used(self, keys: Sequence[ChunkKey], first_depth: int, stamp: float) -> None:
        """A request with use stamp `stamp` uses `keys` (chunks first_depth, +1, ...)."""

    def saved(self, key: ChunkKey, depth: int, stamp: float) -> None:
        """Every stage stored `key` (chunk `depth` of a chain), for a request of `stamp`."""

    def missing(self, key: ChunkKey) -> bool:
        """A lookup found `key` absent on some stage: forget it. True if it was held
        (what is left of it should be removed)."""
        return False

    def victims(self, now: float | None = None) -> list[ChunkKey]:
        """Chunks to remove now to get back within the budget (forgotten here)."""
        return []

    @property
    def num_chunks(self) -> int:
        return 0


class LruChainRetention(Retention):
    """Owns the chunks this client saved: key -> (use stamp, depth), and the budget.
    Over the budget, `victims` returns the least recently used chunks, deepest first
    within one stamp, down to `low_water` of the budget (removals come in batches)."""

    name = "client"

    def __init__(
        self, budget_chunks: int, *, protect_s: float = PROTECT_S, low_water: float = 0.97
    ) -> None:
        if budget_chunks < 1:
            raise ValueError(f"a retention budget of {budget_chunks} chunks holds nothing")
        self.budget = budget_chunks
        self.protect_s = protect_s
        self.target = max(1, int(budget_chunks * low_water))
        self._chunks: dict[ChunkKey, tuple[float, int]] = {}
        self._touched: dict[ChunkKey, float] = {}
        """Monotonic time of each chunk's last use (protection), beside its stamp."""

    def used(self, keys: Sequence[ChunkKey], first_depth: int, stamp: float) -> None:
        now = time.monotonic()
        for i, k in enumerate(keys):
            old = self._chunks.get(k)
            if old is not None:
                self._chunks[k] = (max(old[0], stamp), first_depth + i)
                self._touched[k] = now

    def saved(self, key: ChunkKey, depth: int, stamp: float) -> None:
        old = self._chunks.get(key)
        self._chunks[key] = (stamp if old is None else max(old[0], stamp), depth)
        self._touched[key] = time.monotonic()

    def missing(self, key: ChunkKey) -> bool:
        self._touched.pop(key, None)
        return self._chunks.pop(key, None) is not None

    def victims(self, now: float | None = None) -> list[ChunkKey]:
        if len(self._chunks) <= self.budget:
            return []
        now = time.monotonic() if now is None else now
        over = len(self._chunks) - self.target
        order = heapq.nsmallest(
            over,
            (
                (stamp, -depth, k)
                for k, (stamp, depth) in self._chunks.items()
                if now - self._touched[k] >= self.protect_s
            ),
        )
        out = [k for _, _, k in order]
        for k in out:
            self.missing(k)
        return out

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

"""The caches of the pool simulator (benchmarks/pool_policy_sim.py): the GPU prefix cache
and the pool with Mooncake's eviction or the client's retention.

Mooncake's own eviction (master_service.cpp BatchEvict, 0.3.13), modelled as it is: above
the high watermark (0.9) a pass evicts a fraction (0.05 + the excess) of the OBJECTS, shard
by shard over 1024 hash shards (a random first shard); each shard evicts its share of
the running quota from its own lease-expired, unpinned objects, those with the oldest
lease_timeout first, and ties at the cut all go. A put leaves lease_timeout at the epoch
(never read objects are the oldest); batch_is_exist and reads grant a 10 s lease. A soft
pin makes an object a second-pass candidate (evicted only when too few others are), its
timeout renewed on every lease. With ~2,300 objects of 32 MiB over 1024 shards a shard
holds ~2 of them, so "approximately LRU" is close to random in practice, and a random
hole in a session's chain loses everything behind it (the hit rule is a leading run).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN_BYTES = 131_072
CHUNK_TOKENS = 256
NUM_SHARDS = 1024
LEASE_S = 10.0
WATERMARK = 0.9
EVICT_RATIO = 0.05
OBJECT_OVERHEAD = 4096
"""Header and slot alignment of a pool object beside its payload."""


class GpuCache:
    """Prefix cache of `capacity` trace blocks, LRU, a request's blocks freed tail-first
    (engine/block_pool.py). `on_evict(key)` hears every eviction (the victim policies)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # front = evicted first
        self.on_evict: Callable[[int], None] | None = None

    def hit(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for k in reversed(keys):  # tail first: the prefix is evicted last
            if k in self.lru:
                self.lru.move_to_end(k)
            else:
                self.lru[k] = None
        while len(self.lru) > self.capacity:
            k, _ = self.lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(k)


# -- the pool ---------------------------------------------------------------------------------
@dataclass
class _Obj:
    shard: int
    lease: float = -1.0  # lease_timeout; -1: the epoch (never read)
    pin_until: float = -1.0
    touched: float = 0.0  # the client's recency (a request's use stamp)
    depth: int = 0  # chunk index in its chain (tail-first ties)
    used_at: float = 0.0  # when last used (the client never removes one used < 10 s ago)


@dataclass
class Pool:
    """Chunk objects in a store of `capacity` objects; Mooncake's eviction, or the
    client's own (budget) when `client_budget` is set."""

    capacity: int
    rng: random.Random
    client_budget: float | None = None
    pin_ttl_s: float = 0.0
    objs: dict[int, _Obj] = field(default_factory=dict)
    evicted: int = 0

    def exists(self, keys: list[int], now: float, lease: bool = True) -> list[bool]:
        out = []
        for k in keys:
            o = self.objs.get(k)
            out.append(o is not None)
            if o is not None and lease:
                o.lease = max(o.lease, now + LEASE_S)
                if o.pin_until >= 0:
                    o.pin_until = max(o.pin_until, now + self.pin_ttl_s)
        return out

    def touch(self, keys: list[int], now: float, first_depth: int) -> None:
        for i, k in enumerate(keys):
            o = self.objs.get(k)
            if o is not None:
                o.touched = max(o.touched, now)
                o.depth = first_depth + i
                o.used_at = now

    def put(
        self, keys: list[int], now: float, first_depth: int, stamp: float | None = None
    ) -> None:
        for i, k in enumerate(keys):
            if k in self.objs:
                continue  # put of an existing key: 0, nothing changes
            if self.client_budget is not None:
                self._client_evict(now, reserve=1)
            elif len(self.objs) >= self.capacity:
                self._mooncake_evict(now, EVICT_RATIO)
                if len(self.objs) >= self.capacity:
                    continue  # NO_SPACE (retried once in the client; ignored here)
            pin = now + self.pin_ttl_s if self.pin_ttl_s > 0 else -1.0
            recency = now if stamp is None else stamp
            self.objs[k] = _Obj(hash(k) % NUM_SHARDS, -1.0, pin, recency, first_depth + i, now)
            if self.client_budget is None and len(self.objs) > WATERMARK * self.capacity:
                excess = len(self.objs) / self.capacity - WATERMARK
                self._mooncake_evict(now, EVICT_RATIO + excess)

    def remove(self, keys: list[int]) -> None:
        for k in keys:
            self.objs.pop(k, None)

    def _client_evict(self, now: float, reserve: int) -> None:
        assert self.client_budget is not None
        limit = int(self.client_budget * self.capacity) - reserve
        if len(self.objs) <= limit:
            return
        over = len(self.objs) - int(limit * 0.97)  # removals come in batches
        # Least recently used first; within one recency the deepest chunk first, so a
        # chain loses its tail and keeps a usable prefix. Chunks used in the last 10 s
        # stay (a load may be reading them).
        order = sorted(
            (o.touched, -o.depth, k) for k, o in self.objs.items() if now - o.used_at >= LEASE_S
        )
        for _, _, k in order[:over]:
            del self.objs[k]
            self.evicted += 1

    def _mooncake_evict(self, now: float, target: float) -> None:
        shards: dict[int, list[int]] = {}
        for k, o in self.objs.items():
            shards.setdefault(o.shard, []).append(k)
        start = self.rng.randrange(NUM_SHARDS)
        count = evicted = 0
        second: list[tuple[float, int]] = []
        pinned: list[tuple[float, int]] = []
        for i in range(NUM_SHARDS):
            keys = shards.get((start + i) % NUM_SHARDS, [])
            count += len(keys)
            quota = -(-int(count * target * 1e9) // int(1e9)) - evicted
            cands = []
            for k in keys:
                o = self.objs[k]
                if o.lease > now:
                    continue
                if o.pin_until > now:
                    pinned.append((o.lease, k))
                elif quota > 0:
                    cands.append((o.lease, k))
                else:
                    second.append((o.lease, k))
            if quota > 0 and cands:
                cands.sort()
                cut = cands[min(quota, len(cands)) - 1][0]
                for lease, k in cands:
                    if lease <= cut:
                        del self.objs[k]
                        evicted += 1
                    else:
                        second.append((lease, k))
        want = -(-int(count * EVICT_RATIO * 1e9) // int(1e9)) - evicted
        if want > 0:
            pool = sorted(second) + sorted(pinned)
            for _, k in pool[:want]:
                self.objs.pop(k, None)
                evicted += 1
        self.evicted += evicted

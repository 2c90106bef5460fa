"""The save path of the pool simulator (benchmarks/pool_policy_sim.py): save slots and
the save thread, as prefill_worker/pool_save_queue.py runs them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.pool_sim_cache import CHUNK_TOKENS, TOKEN_BYTES, GpuCache, Pool

if TYPE_CHECKING:
    from benchmarks.pool_sim_replay import Model, Result


@dataclass
class SaveItem:
    """A computed chunk on its way to a save slot."""

    done: float  # computed (packed at once if a slot is free)
    owned_until: float  # its request ends: until then its blocks cannot be evicted
    key: int
    blocks: list[int]
    depth: int
    stamp: float | None
    chain: int  # the request it belongs to


class SavePath:
    """The save slots and the save thread, FIFO: a chunk takes a slot when it is packed
    and frees it when its write ends (writes one at a time at m.save_gbs); chunk i gets
    the slot of chunk i - slots. No slot free when it is computed: dropped (save_wait
    False), or it waits and is packed when the slot frees, if the GPU cache still holds
    all its blocks (else lost, and its chain's later chunks with it, taking no slot).
    `advance(now)` settles every chunk whose slot time is due, before the GPU cache
    changes at `now`."""

    def __init__(self, m: Model, gpu: GpuCache, pool: Pool, res: Result) -> None:
        self.m, self.gpu, self.pool, self.res = m, gpu, pool, res
        self.write_s = CHUNK_TOKENS * TOKEN_BYTES / (m.save_gbs * 1e9)
        self.ends: deque[float] = deque()  # write ends of the last `slots` chunks
        self.writer_free = 0.0
        self.waiting: deque[SaveItem] = deque()
        self.broken: set[int] = set()

    def offer(self, w: SaveItem) -> None:
        self.waiting.append(w)

    def now(self, key: int, depth: int, t: float) -> None:
        """A victim (pool.save victim): saved at once if a slot is free at t, else lost
        (the cache is reusing its blocks)."""
        m = self.m
        full = m.save_slots is not None and len(self.ends) >= m.save_slots
        if full and m.save_slots is not None and self.ends[-m.save_slots] > t:
            self.res.save_lost += 1
            return
        end = max(t, self.writer_free) + self.write_s
        self.writer_free = end
        self.ends.append(end)
        if m.save_slots is not None and len(self.ends) > m.save_slots:
            self.ends.popleft()
        self.res.saved += 1
        self.pool.put([key], t, depth)

    def advance(self, now: float) -> None:
        m = self.m
        while self.waiting:
            w = self.waiting[0]
            slot_t = w.done
            if m.save_slots is not None and len(self.ends) >= m.save_slots:
                slot_t = max(slot_t, self.ends[-m.save_slots])
            if slot_t > now:
                return
            self.waiting.popleft()
            if slot_t > w.done and not m.save_wait:
                self.res.save_dropped += 1
                continue
            if w.chain in self.broken:
                self.res.save_lost += 1
                continue
            if slot_t > w.owned_until and not all(b in self.gpu.lru for b in w.blocks):
                self.res.save_lost += 1
                self.broken.add(w.chain)
                continue
            if slot_t > w.done:
                self.res.save_deferred += 1
            end = max(slot_t, self.writer_free) + self.write_s
            self.writer_free = end
            self.ends.append(end)
            if m.save_slots is not None and len(self.ends) > m.save_slots:
                self.ends.popleft()
            self.res.saved += 1
            self.pool.put([w.key], slot_t, w.depth, w.stamp)

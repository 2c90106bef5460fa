"""SaveQueue: computed prompt chunks waiting for a save slot, saved later from the GPU
prefix cache instead of dropped. Scheduler side of the pool connector, engine thread only.

Every prefill process has the same number of save slots per chunk (`slots`: its
pool_buffer_memory's save slots / its stages). The scheduler side counts, per worker, the
chunks it sent to be packed and that worker has not reported yet; a chunk leaves the
queue only while every worker has a slot for it, so a worker never finds its save slots
full (a worker releases a slot before it reports it: the count is never below the truth).

    step k computes chunks A2 A3 B0 ─▶ queue: A2 A3 B0 ──(credits 1)──▶ PoolSave A2
    step k+1 (reports freed 2 slots)    queue: A3 B0   ──(credits 2)──▶ PoolSave A3, B0
                                          │
    a chunk whose request let go of its blocks is looked up in the prefix cache: every
    one of its block hashes must still be cached (a freed block keeps its content until
    it is reused), and it is packed from the blocks that hold them now; else its KV is
    gone: lost, and so are the request's later chunks (a chunk after a hole is never a
    hit: the hit rule takes a leading run).

Why this is safe to pack: a chunk leaves the queue in build_step_meta, after the step's
allocations. A block that carries the chunk's hash then was not handed to anyone this
step (allocation clears a block's hash), and the worker packs it in start_saves of this
step, in stream order after the forwards that computed it and before any later step's
forward can write into it (the contract of engine/kv_connector.py).

Chains stay in order: a request's chunks enter in chain order and leave in that order;
when one is lost (evicted, or reported unsaved by a worker) the request's deeper chunks
still queued are dropped without taking a slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol.ids import BlockHash, BlockId
from protocol.pool_messages import PoolSave

BlockLookup = Callable[[BlockHash], BlockId | None]
"""The engine's prefix cache: the block holding this content now (None: evicted)."""


@dataclass
class QueuedChunk:
    """One computed chunk waiting for a slot."""

    request_id: str
    key: bytes
    depth: int
    """Its index in the request's chain."""
    block_ids: list[int]
    block_hashes: list[BlockHash]
    stamp: float = 0.0
    """Use stamp of the request (retention)."""
    owned: bool = True
    """The request still holds the blocks (running): nothing can overwrite them."""
    deferred: bool = False
    """It did not leave in the step that computed it."""


@dataclass
class TakeResult:
    """What left the queue in one step."""

    saves: list[PoolSave]
    taken: list[QueuedChunk]
    num_evicted: int = 0
    """Chunks whose blocks the prefix cache reused before a slot freed (lost)."""
    num_behind_hole: int = 0
    """Chunks dropped because an earlier chunk of their chain was lost."""
    num_deferred: int = 0
    """Chunks computed this step that wait for a slot."""


class SaveQueue:
    """Owns the workers' save credits and the chunks waiting for them (module doc)."""

    def __init__(self, slots: int, num_workers: int) -> None:
        assert slots >= 1 and num_workers >= 1
        self.slots = slots
        self._outstanding = [0] * num_workers
        """Per worker: chunks sent to it to pack that it has not reported yet."""
        self._queue: deque[QueuedChunk] = deque()
        self._broken: dict[str, int] = {}
        """Request -> depth of its first lost chunk (its deeper chunks are useless)."""
        self._queued: dict[str, int] = {}
        """Request -> its chunks in the queue."""
        self._done: set[str] = set()
        """Finished requests that still have chunks queued (forgotten when they leave)."""
        self._lookup: BlockLookup | None = None

    def bind(self, lookup: BlockLookup) -> None:
        """The engine's prefix cache (finds a chunk whose request let go of its blocks)."""
        self._lookup = lookup

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def credits(self) -> int:
        """Chunks every worker has a free save slot for now."""
        return max(0, self.slots - max(self._outstanding))

    def add(self, chunks: Sequence[QueuedChunk]) -> None:
        """Chunks a step computes, in chain order (they leave in this order)."""
        self._queue.extend(chunks)
        for c in chunks:
            self._queued[c.request_id] = self._queued.get(c.request_id, 0) + 1

    def take(self) -> TakeResult:
        """The chunks that leave now, grouped into PoolSave messages (one per run of the
        same request), while every worker has a slot; lost ones are dropped on the way."""
        out = TakeResult([], [])
        budget = self.credits
        while self._queue:
            c = self._queue[0]
            hole = self._broken.get(c.request_id)
            if hole is not None and c.depth > hole:
                self._pop()
                out.num_behind_hole += 1
                continue
            blocks = self._blocks(c)
            if blocks is None:
                self.lost(c.request_id, c.depth)  # before _pop: it may forget the request
                self._pop()
                out.num_evicted += 1
                continue
            if budget == 0:
                break
            self._pop()
            budget -= 1
            out.taken.append(c)
            last = out.saves[-1] if out.saves else None
            if last is not None and last.request_id == c.request_id:
                last.chunk_keys.append(c.key)
                last.block_ids.append(blocks)
            else:
                out.saves.append(PoolSave(c.request_id, [c.key], [blocks]))
        for w in range(len(self._outstanding)):
            self._outstanding[w] += len(out.taken)
        for c in reversed(self._queue):  # the newly computed ones are at the end
            if c.deferred:
                break
            c.deferred = True
            out.num_deferred += 1
        return out

    def _pop(self) -> None:
        rid = self._queue.popleft().request_id
        self._queued[rid] -= 1
        if self._queued[rid] == 0:
            del self._queued[rid]
            if rid in self._done:
                self._done.discard(rid)
                self._broken.pop(rid, None)

    def _blocks(self, c: QueuedChunk) -> list[int] | None:
        """Where the chunk's KV is now, or None if the prefix cache let some of it go."""
        if c.owned:
            return c.block_ids
        if self._lookup is None:
            return None
        out = []
        for h in c.block_hashes:
            b = self._lookup(h)
            if b is None:
                return None
            out.append(int(b))
        return out

    def take_now(self, chunks: Sequence[QueuedChunk]) -> tuple[list[PoolSave], int]:
        """Chunks that must leave this step or never (pool.save victim: the cache
        evicts them), before the queue: (their saves, how many found no slot)."""
        n = min(len(chunks), self.credits)
        saves = [PoolSave(c.request_id, [c.key], [c.block_ids]) for c in chunks[:n]]
        for w in range(len(self._outstanding)):
            self._outstanding[w] += n
        return saves, len(chunks) - n

    def reported(self, worker: int, num_chunks: int) -> None:
        """A worker reported chunks stored or not: their slots are free again."""
        self._outstanding[worker] = max(0, self._outstanding[worker] - num_chunks)

    def withdrawn(self, num_chunks: int) -> None:
        """Chunks sent this step that no worker will pack (their forward failed)."""
        for w in range(len(self._outstanding)):
            self._outstanding[w] = max(0, self._outstanding[w] - num_chunks)

    def released(self, request_id: str, *, finished: bool) -> None:
        """The request let go of its blocks (finished, or preempted): its queued chunks
        are checked against the block pool from now on. A finished request's
        bookkeeping goes once its last queued chunk has left."""
        if request_id in self._queued:
            for c in self._queue:
                if c.request_id == request_id:
                    c.owned = False
            if finished:
                self._done.add(request_id)
        elif finished:
            self._broken.pop(request_id, None)

    def lost(self, request_id: str, depth: int, *, live: bool = True) -> None:
        """Chunk `depth` of the request will not be in the pool: its deeper ones are
        useless there (queued ones, and those a `live` request computes later)."""
        if not live and request_id not in self._queued:
            return
        old = self._broken.get(request_id)
        self._broken[request_id] = depth if old is None else min(old, depth)


class ResidentChunks:
    """pool.save "victim": the computed chunks the GPU prefix cache holds and the pool
    does not yet, by each of their block hashes. Owns that map; `evicted` turns the
    cache's evictions (engine/block_pool.py `on_evict`) into chunks to save this step.

    A chunk is due at the first eviction of any of its blocks: its other blocks are then
    either evicted by the same call (their content is intact until this step's forward)
    or still cached (found by hash), so it is packed whole, before the forward, in
    start_loads. At most `capacity` chunks are tracked (the oldest are forgotten: a reset
    prefix cache evicts nothing, it forgets)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._chunks: dict[bytes, QueuedChunk] = {}
        self._chunk_of: dict[BlockHash, bytes] = {}
        self.due: list[QueuedChunk] = []
        """Chunks to save this step (build_step_meta takes them)."""
        self.num_lost = 0
        """Chunks due whose blocks could not all be found (cumulative, drained)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, chunks: Sequence[QueuedChunk]) -> None:
        for c in chunks:
            if c.key in self._chunks:
                continue
            self._chunks[c.key] = c
            for h in c.block_hashes:
                self._chunk_of[h] = c.key
        while len(self._chunks) > self.capacity:
            self._forget(next(iter(self._chunks)))

    def _forget(self, key: bytes) -> QueuedChunk:
        c = self._chunks.pop(key)
        for h in c.block_hashes:
            if self._chunk_of.get(h) == key:
                del self._chunk_of[h]
        return c

    def evicted(self, pairs: Sequence[tuple[BlockId, BlockHash]], lookup: BlockLookup) -> None:
        """The cache evicts these (block, hash) pairs now (engine thread, inside allocate)."""
        here = {h: b for b, h in pairs}
        for _, h in pairs:
            key = self._chunk_of.get(h)
            if key is None:
                continue
            c = self._forget(key)
            blocks = []
            for hh in c.block_hashes:
                b = here.get(hh)
                if b is None:
                    b = lookup(hh)
                if b is None:
                    break
                blocks.append(int(b))
            if len(blocks) < len(c.block_hashes):
                self.num_lost += 1
                continue
            c.block_ids = blocks
            self.due.append(c)

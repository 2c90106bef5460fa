"""PoolLookups: the pool connector's lookups, off the engine thread (pool_connector.py).

    engine thread (PoolScheduler)               pool-lookup thread
    matched(request's chunks) ── queue ───────▶ client.lookup(keys): leading chunks
      None while in flight                      every stage holds (never raises)
      the answer once back, reused while  ◀──── hit, done_at; wake() the engine
      fresh (LOOKUP_FRESH_S)
    remove_later(keys) ───────── queue ───────▶ client.remove_chunks (retention)

A lookup is a network call to the master: asking on the engine thread would stall every
request's step for it, so a request whose answer is not back stays waiting (None) and
the engine is woken when it is. The first answer read is told to the retention policy
(its hits are in use; the first missing chunk is gone).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.client import PoolClient
from kvpool.retention import Retention
from protocol.ids import ChunkKey, RequestId

LOOKUP_FRESH_S = 1.0
"""How long a lookup's answer is reused for a request still waiting (for blocks or a
running slot), well inside the read lease the lookup took (lease_ttl_s, 10 s)."""


@dataclass
class _Lookup:
    first: int
    last: int
    """Chunks [first, last) asked about."""
    keys: list[ChunkKey]
    hit: int | None = None
    """Leading chunks every stage holds; None while the lookup is in flight."""
    done_at: float = 0.0
    seen: bool = False
    """Its answer was handed to the retention policy (a chunk found missing)."""


class PoolLookups:
    """Owns the lookup thread, the lookups by request and the queued removals. Every
    method but the thread's own runs on the engine thread; `_lock` guards what both
    touch (a lookup's answer, the removal count)."""

    def __init__(
        self,
        client: PoolClient,
        retention: Retention,
        on_removed: Callable[[list[ChunkKey]], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.retention = retention
        self._on_removed = on_removed
        self._wake = wake
        self._lookups: dict[RequestId, _Lookup] = {}
        """Lookups by request (guarded by _lock: the lookup thread fills in `hit`)."""
        self._removals = 0
        """Removal batches queued for the lookup thread and not done (guarded by _lock)."""
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[RequestId, _Lookup] | list[ChunkKey] | None] = queue.Queue()
        """Lookups, and chunks to remove (retention), for the lookup thread."""
        self._thread = threading.Thread(target=self._loop, name="pool-lookup", daemon=True)
        self._thread.start()

    def matched(
        self,
        rid: RequestId,
        first: int,
        last: int,
        num_computed_tokens: int,
        keys: Callable[[int, int], list[ChunkKey]],
        stamp: float,
    ) -> int | None:
        """Tokens past `num_computed_tokens` the pool holds of the request's prompt chunks
        [first, last) (on every stage), or None while the lookup is in flight (asked now
        when there is no fresh answer for these chunks). `keys(first, last)`: the chunks'
        keys; `stamp`: the request's use stamp (retention)."""
        cs = self.client.chunk_size
        if first >= last:
            self.forget(rid)
            return 0
        now = time.monotonic()
        with self._lock:
            look = self._lookups.get(rid)
            answer = None if look is None or look.seen else look.hit
            if answer is not None and look is not None:
                look.seen = True
        if answer is not None and look is not None:  # first time this answer is read
            self._answered(look, stamp)
        with self._lock:
            look = self._lookups.get(rid)
            # An answer covering these chunks is reused while fresh (a request that waits
            # for blocks asks every step; its GPU prefix may grow meanwhile).
            if look is not None and look.first <= first and look.last == last:
                if look.hit is None:
                    return None  # still in flight
                if now - look.done_at < LOOKUP_FRESH_S:
                    end = look.first + look.hit  # chunks [look.first, end) on every stage
                    return max(0, end * cs - num_computed_tokens) if end > first else 0
            # A new question (or a stale answer): ask the pool on the lookup thread; the
            # request stays waiting until it is back.
            look = _Lookup(first, last, keys(first, last))
            self._lookups[rid] = look
        self._queue.put((rid, look))
        return None

    def forget(self, rid: RequestId) -> None:
        """The request's lookup is used (admitted) or no longer needed (finished)."""
        with self._lock:
            self._lookups.pop(rid, None)

    def remove_later(self, keys: list[ChunkKey]) -> None:
        """Remove these chunks from the pool on the lookup thread (a network call)."""
        with self._lock:
            self._removals += 1
        self._queue.put(keys)

    def in_flight(self) -> bool:
        """A lookup or a removal is not done yet."""
        with self._lock:
            return self._removals > 0 or any(look.hit is None for look in self._lookups.values())

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _answered(self, look: _Lookup, stamp: float) -> None:
        """Retention hears what the lookup found: its hits are about to be read (kept),
        the first chunk missing on some stage is gone (the objects its other stages may
        still hold are removed: they can never be a hit)."""
        assert look.hit is not None
        self.retention.used(look.keys[: look.hit], look.first, stamp)
        if look.hit < len(look.keys) and self.retention.missing(look.keys[look.hit]):
            self.remove_later([look.keys[look.hit]])
            if self._on_removed is not None:  # no longer a hit: routing must not count it
                self._on_removed([look.keys[look.hit]])

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, list):  # retention: chunks this instance removes
                self.client.remove_chunks(item)
                with self._lock:
                    self._removals -= 1
                continue
            rid, look = item
            with self._lock:
                if self._lookups.get(rid) is not look:
                    continue  # finished or asked again meanwhile
            hit = self.client.lookup(look.keys)  # never raises: 0 when the pool is away
            with self._lock:
                look.hit = hit
                look.done_at = time.monotonic()
            if self._wake is not None:
                self._wake()

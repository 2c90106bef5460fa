"""StageCounters: a pool client's counters in a process that exports no metrics.

Every stage process of a prefill instance saves and loads its own objects, but only stage 0
serves /metrics. So a worker's PoolClient counts into StageCounters (the same calls it
makes on PoolMetrics), the worker drains them into each report (PoolCounts), and stage 0
adds them to its PoolMetrics (`PoolMetrics.apply`). Thread-safe: the load, save and
engine threads all count.
"""

from __future__ import annotations

import threading
from collections import Counter

from protocol.pool_messages import PoolCounts, PoolFailure


class _Count:
    """One counter with prometheus_client's `inc` signature."""

    def __init__(self, owner: StageCounters, name: str) -> None:
        self._owner, self._name = owner, name

    def inc(self, amount: float = 1) -> None:
        self._owner.add(self._name, int(amount))


class StageCounters:
    """Owns counts since the last drain; same counting calls as PoolMetrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scalars: Counter[str] = Counter()
        self._failures: Counter[tuple[str, str]] = Counter()
        self._objects: Counter[tuple[str, int]] = Counter()
        self._restores: list[tuple[int, float]] = []
        self._phases: dict[tuple[int, str], float] = {}
        self.load_bytes = _Count(self, "load_bytes")
        self.save_bytes = _Count(self, "save_bytes")
        self.checksum_failures = _Count(self, "checksum_failures")
        self.load_in_place = _Count(self, "load_in_place")
        self.save_dropped = _Count(self, "save_dropped")
        self.save_chunks = _Count(self, "save_chunks")
        """Counted by the scheduler side when every stage stored a chunk; ignored here."""

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self._scalars[name] += n

    def failure(self, op: str, reason: str, n: int = 1) -> None:
        with self._lock:
            self._failures[(op, reason)] += n

    def lookup(self, num_hit: int, num_miss: int) -> None:
        with self._lock:
            self._scalars["lookups"] += 1
            self._scalars["hit_chunks"] += num_hit
            self._scalars["miss_chunks"] += num_miss

    def stage_objects(self, op: str, stage: int, n: int) -> None:
        if n:
            with self._lock:
                self._objects[(op, stage)] += n

    def restore(self, stage: int, seconds: float) -> None:
        with self._lock:
            self._restores.append((stage, seconds))

    def restore_phase(self, stage: int, phase: str, seconds: float) -> None:
        with self._lock:
            self._phases[(stage, phase)] = self._phases.get((stage, phase), 0.0) + seconds

    def drain(self) -> PoolCounts:
        """Everything counted since the last drain (and reset)."""
        with self._lock:
            s = self._scalars
            out = PoolCounts(
                lookups=s["lookups"],
                hit_chunks=s["hit_chunks"],
                miss_chunks=s["miss_chunks"],
                load_bytes=s["load_bytes"],
                save_bytes=s["save_bytes"],
                checksum_failures=s["checksum_failures"],
                load_in_place=s["load_in_place"],
                save_dropped=s["save_dropped"],
                failures=[PoolFailure(op, r, n) for (op, r), n in self._failures.items()],
                restore_seconds=list(self._restores),
                saved_objects=[(st, n) for (op, st), n in self._objects.items() if op == "save"],
                loaded_objects=[(st, n) for (op, st), n in self._objects.items() if op == "load"],
                restore_phases=[(st, ph, s) for (st, ph), s in self._phases.items()],
            )
            self._phases.clear()
            self._scalars.clear()
            self._failures.clear()
            self._objects.clear()
            self._restores.clear()
        return out

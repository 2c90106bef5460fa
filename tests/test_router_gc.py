"""router/server.py tune_gc: the startup heap frozen, the young generation's threshold raised,
cyclic garbage still collected."""

from __future__ import annotations

import gc
import weakref

from router.server import GC_YOUNG_THRESHOLD, tune_gc


class _Node:
    def __init__(self) -> None:
        self.me = self


def test_tune_gc_freezes_and_raises_the_threshold() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        cycle = _Node()
        ref = weakref.ref(cycle)
        del cycle
        assert ref() is not None  # a cycle waits for the collector...
        gc.collect()
        assert ref() is None  # ...which still frees it
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

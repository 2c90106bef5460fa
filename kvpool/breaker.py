"""Breaker: stop calling a pool that does not answer, and find out when it is back.

A dead master makes every Mooncake call take ~4 s before it fails (MOONCAKE.md §6). The
engine thread's lookups must not pay that on every request, so the first failure opens
the breaker: callers then skip the pool at once (a miss, a dropped save), and one
background probe retries with growing back-off (0.5 s doubling to 8 s) until a call
succeeds, which closes it.

    closed ──failure──▶ open ──probe ok──▶ closed
                         └──probe fails──▶ open (back-off x2)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


class Breaker:
    """Owns the open/closed state and the probe thread of one pool client."""

    def __init__(
        self,
        probe: Callable[[], None],
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self._probe = probe
        self._first = first_backoff_s
        self._max = max_backoff_s
        self._open = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_trips = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, why: str) -> None:
        """A call failed because the pool is unreachable: open, start probing."""
        with self._lock:
            if self._open or self._stop.is_set():
                return
            self._open = True
            self.num_trips += 1
            log.warning("pool unreachable (%s): skipping it until a probe succeeds", why)
            self._thread = threading.Thread(target=self._run, name="pool-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        backoff = self._first
        while not self._stop.wait(backoff):
            try:
                self._probe()
            except Exception as e:  # any failure: still down
                log.debug("pool probe failed: %s", e)
                backoff = min(backoff * 2, self._max)
                continue
            with self._lock:
                self._open = False
            log.warning("pool reachable again: using it")
            return

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)

"""HealthMonitor: polls GET /health of every instance, restoring or marking them.

A failed connection during serving marks an instance unhealthy at once (router/relay.py);
this loop is what brings it back once it answers again, and what notices an instance that
died while idle. One poll of all instances runs concurrently, each bounded by
`router.health_timeout_s`, then the loop sleeps out the rest of the interval.

Every failed poll marks the instance unhealthy (no new requests go to it). A refused
connection or an answer other than 200 also marks it down (the process is gone or says
it cannot serve: requests bound to it fail at once, router/decode_bindings.py). A
timed-out poll is a failure too: the first one could be a slow moment of a busy process,
so it only stops routing, and `timeouts_down` timed-out polls in a row mark it down (a
process that keeps its port open but never answers, e.g. one whose event loop is stuck).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.instances import Instance, InstanceRegistry
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)

TIMEOUTS_DOWN = 3
"""Timed-out health polls in a row that mark an instance down (with the default 1 s
interval and 1 s health timeout: about 3-6 s of silence)."""


class HealthMonitor:
    """Owns the background polling task; start() and stop() on the router's event loop."""

    def __init__(
        self,
        registry: InstanceRegistry,
        client: WorkerClient,
        interval_s: float,
        timeouts_down: int = TIMEOUTS_DOWN,
    ) -> None:
        self._registry = registry
        self._client = client
        self._interval_s = interval_s
        self._timeouts_down = timeouts_down
        self._timeouts: dict[str, int] = {}
        """Instance url -> timed-out polls in a row."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def poll_once(self) -> None:
        instances = self._registry.all()
        results = await asyncio.gather(*(self._client.health(i) for i in instances))
        for inst, (error, incarnation) in zip(instances, results, strict=True):
            self._apply(inst, error, incarnation)

    def _apply(self, inst: Instance, error: str | None, incarnation: str) -> None:
        timed_out = error is not None and error.split(":", 1)[0].endswith("Timeout")
        # httpx's *Timeout errors; any other outcome ends a run of timeouts
        streak = self._timeouts.get(inst.url, 0) + 1 if timed_out else 0
        self._timeouts[inst.url] = streak
        if error is None:
            if not inst.healthy:
                log.info("%s is healthy again", inst.describe())
            elif inst.incarnation and incarnation and incarnation != inst.incarnation:
                log.info("%s was restarted (a new process answers)", inst.describe())
            self._registry.mark_healthy(inst, incarnation)
        else:
            down = not timed_out or streak >= self._timeouts_down
            if timed_out:
                error = f"{error} ({streak} timed-out health polls in a row)"
            if inst.healthy or (timed_out and streak == self._timeouts_down):
                log.warning("%s is unhealthy%s: %s", inst.describe(), " (down)" * down, error)
            self._registry.mark_unhealthy(inst, error, down=down)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except Exception:  # never let one bad poll end health checking
                log.exception("health poll failed")
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started)))

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

`kvserve up` starts the router beside the workers: the router polls every instance once
before it serves, then every STARTUP_INTERVAL_S until each has answered once (an instance
not answering yet is only waited for, not reported), then every `interval_s`.
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

STARTUP_INTERVAL_S = 0.05
"""Poll period while some instance has never answered since the router started: `kvserve
up` starts the router beside the workers, so it notices each one as soon as it serves
rather than up to a whole interval later."""


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
        self._answered: set[tuple[str, str]] = set()
        """(role, name) of the instances that have answered a poll since the router
        started."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One poll of every instance, then the polling task. Awaited before the router
        serves, so its first requests go only to the instances that answered."""
        if self._task is None:
            await self._poll_guarded()
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
        key = (inst.role, inst.name)
        first = key not in self._answered
        if error is None:
            self._answered.add(key)
            if first:
                log.info("%s answers", inst.describe())
            elif not inst.healthy:
                log.info("%s is healthy again", inst.describe())
            elif inst.incarnation and incarnation and incarnation != inst.incarnation:
                log.info("%s was restarted (a new process answers)", inst.describe())
            self._registry.mark_healthy(inst, incarnation)
        else:
            down = not timed_out or streak >= self._timeouts_down
            if timed_out:
                error = f"{error} ({streak} timed-out health polls in a row)"
            if first:
                if inst.healthy:  # not an error yet: it may still be starting
                    log.info("waiting for %s to answer: %s", inst.describe(), error)
            elif inst.healthy or (timed_out and streak == self._timeouts_down):
                log.warning("%s is unhealthy%s: %s", inst.describe(), " (down)" * down, error)
            self._registry.mark_unhealthy(inst, error, down=down)

    @property
    def interval_s(self) -> float:
        """The period of the next poll: STARTUP_INTERVAL_S while an instance has never
        answered, the configured interval once all have."""
        if any((i.role, i.name) not in self._answered for i in self._registry.all()):
            return min(self._interval_s, STARTUP_INTERVAL_S)
        return self._interval_s

    async def _poll_guarded(self) -> None:
        try:
            await self.poll_once()
        except Exception:  # never let one bad poll end health checking
            log.exception("health poll failed")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()  # start() has just polled
        while True:
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - last)))
            last = loop.time()
            await self._poll_guarded()

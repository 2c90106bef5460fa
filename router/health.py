"""HealthMonitor: polls GET /health of every instance, restoring or marking them.

A failed connection during serving marks an instance unhealthy at once (router/relay.py);
this loop is what brings it back once it answers again, and what notices an instance that
died while idle. One poll of all instances runs concurrently, each bounded by the
client's control timeout, then the loop sleeps out the rest of the interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.instances import Instance, InstanceRegistry
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)


class HealthMonitor:
    """Owns the background polling task; start() and stop() on the router's event loop."""

    def __init__(self, registry: InstanceRegistry, client: WorkerClient, interval_s: float) -> None:
        self._registry = registry
        self._client = client
        self._interval_s = interval_s
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
        if error is None:
            if not inst.healthy:
                log.info("%s is healthy again", inst.describe())
            elif inst.incarnation and incarnation and incarnation != inst.incarnation:
                log.info("%s was restarted (a new process answers)", inst.describe())
            self._registry.mark_healthy(inst, incarnation)
        else:
            if inst.healthy:
                log.warning("%s is unhealthy: %s", inst.describe(), error)
            # A timed-out poll (httpx's *Timeout errors) is a slow process, not a dead one:
            # requests bound to it keep waiting.
            slow = error.split(":", 1)[0].endswith("Timeout")
            self._registry.mark_unhealthy(inst, error, down=not slow)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except Exception:  # never let one bad poll end health checking
                log.exception("health poll failed")
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started)))

"""EngineHost: an EngineLoop bridged to the asyncio event loop of a worker's HTTP server.

    handler ── await host.call(fn) ──▶ engine thread runs fn(engine)
    handler ◀─ stream.get() ◀── call_soon_threadsafe ◀── RequestOutput of a step

Each request with an open stream has one asyncio.Queue; outputs for requests without a
stream are dropped (they were aborted). Runs on the event loop unless said otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepFailed(Exception):
    """Delivered into every open stream when an engine step raised: the request is lost."""

    status = 500


class InstanceLost(StepFailed):
    """A process of this instance (a TP rank, a PP stage) died: every request fails with
    a 503 (retry elsewhere), new ones too, until the instance is restarted."""

    status = 503


class RequestIdInUse(Exception):
    """A request arrived with the id of one that still has an open stream here (a 409:
    opening a second stream would silently take the first one's outputs)."""


class EngineHost:
    """Owns the engine loop and the per-request output queues of one worker process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.loop = EngineLoop(engine, self._deliver, self._step_failed)
        self.lost: str | None = None
        """Why the instance is lost (a process of it died), or None."""
        self.probe_lost: Callable[[], str | None] | None = None
        """Asked when a step failed: is a process of the instance gone (the reason)?"""

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread; its result or exception comes back here.
        InstanceLost at once when the instance is lost (its engine may be stuck in a
        collective with the dead process)."""
        if self.lost is not None:
            raise InstanceLost(self.lost)
        return await asyncio.wrap_future(self.loop.submit(fn))

    def instance_lost(self, reason: str) -> None:
        """A process of the instance died (any thread): fail every open stream with a
        503 now, and every later call."""
        if self.lost is not None:
            return
        self.lost = reason
        log.error("%s: failing every request", reason)
        self.loop.halt()  # no step can complete without the dead process
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._fail_all, InstanceLost(reason))

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """The request's output queue; RequestIdInUse if that id has one already."""
        if request_id in self._streams:
            raise RequestIdInUse(f"request id {request_id!r} is already in use")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deliver(self, out: RequestOutput) -> None:
        """Put an output produced outside a step (by a function run through `call`) into
        its request's stream. Engine thread."""
        self._deliver(out)

    async def abort(self, request_id: str) -> bool:
        """Free the request in the engine and end its stream. True if it was live."""
        self.close_stream(request_id)
        return await self.call(lambda e: e.abort(request_id))

    # -- engine thread side --------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._put, out.request_id, out)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(item)

    def _step_failed(self, err: BaseException) -> None:
        """A step raised: the engine's requests are in an unknown state. Abort them all
        (engine thread) and fail every open stream with the cause (InstanceLost when the
        step broke because a process of the instance died)."""
        why = self.lost or (self.probe_lost() if self.probe_lost is not None else None)
        if why is not None:
            self.instance_lost(why)
            return
        self.engine.abort_all()
        assert self._aloop is not None
        failure = StepFailed(f"engine step failed: {type(err).__name__}: {err}")
        self._aloop.call_soon_threadsafe(self._fail_all, failure)

    def _fail_all(self, failure: StepFailed) -> None:
        for rid in list(self._streams):
            self._put(rid, failure)

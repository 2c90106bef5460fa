"""EngineHost: an EngineLoop bridged to the asyncio event loop of a worker's HTTP server.

    handler ── await host.call(fn) ──▶ engine thread runs fn(engine)
    handler ◀─ stream.get() ◀── call_soon_threadsafe ◀── RequestOutput of a step

Each request with an open stream has one asyncio.Queue; outputs for requests without a
stream are dropped (they were aborted). Runs on the event loop unless said otherwise.

Stall watchdog: a worker whose engine thread is stuck in one step (or one submitted
function) for `stall_timeout_s` is stalled: /health answers 503 with the reason (the
router stops routing to it), every open stream fails with a 503 and later calls fail at
once instead of queuing behind the stuck step. When the step returns the worker serves
again (a slow step is not a dead process; a lost process is `instance_lost`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

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


class EngineStalled(StepFailed):
    """The engine thread has made no progress for the stall timeout while it had work:
    every open request fails with a 503 (retry elsewhere), new calls too, until a step
    completes again."""

    status = 503


class RequestIdInUse(Exception):
    """A request arrived with the id of one that still has an open stream here (a 409:
    opening a second stream would silently take the first one's outputs)."""


class EngineHost:
    """Owns the engine loop and the per-request output queues of one worker process."""

    def __init__(self, engine: LLMEngine, stall_timeout_s: float | None = None) -> None:
        """`stall_timeout_s`: how long one step may run before the worker reports itself
        stalled (None: never)."""
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.loop = EngineLoop(engine, self._deliver, self._step_failed)
        self.lost: str | None = None
        """Why the instance is lost (a process of it died), or None."""
        self.probe_lost: Callable[[], str | None] | None = None
        """Asked when a step failed: is a process of the instance gone (the reason)?"""
        self.stall_timeout_s = stall_timeout_s
        self.stalled: str | None = None
        """Why the engine loop counts as stalled (no progress for stall_timeout_s), or None."""
        self._watchdog: asyncio.Task[None] | None = None
        self._calls: set[Future[Any]] = set()
        """Functions `call` submitted that have not finished: a stall cancels them."""
        self._stall_seen = asyncio.Event()

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._aloop = asyncio.get_running_loop()
        self.loop.start()
        if self.stall_timeout_s is not None:
            self._watchdog = self._aloop.create_task(self._watch(self.stall_timeout_s))

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.loop.stop()

    def unhealthy(self) -> str | None:
        """Why /health must answer 503 (a lost process, a stopped or stalled engine
        thread), or None when the worker serves."""
        if self.lost is not None:
            return self.lost
        if not self.loop.is_alive():
            return "engine thread stopped"
        return self.stalled

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread; its result or exception comes back here.
        InstanceLost at once when the instance is lost (its engine may be stuck in a
        collective with the dead process)."""
        if self.lost is not None:
            raise InstanceLost(self.lost)
        if self.stalled is not None:
            raise EngineStalled(self.stalled)
        fut = self.loop.submit(fn)
        self._calls.add(fut)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # cancelled by the stall watchdog (check_stall), not by our own caller: a 503
            task = asyncio.current_task()
            if fut.cancelled() and self.stalled is not None and not (task and task.cancelling()):
                raise EngineStalled(self.stalled) from None
            raise
        finally:
            self._calls.discard(fut)

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
        """Free the request in the engine and end its stream. True if it was live. While
        the engine loop is stalled the abort is queued behind the stuck step (it runs if
        that step returns) and False comes back at once."""
        self.close_stream(request_id)
        if self.lost is not None:
            raise InstanceLost(self.lost)
        # Not through `call`: a stall must not cancel an abort, only stop waiting for it.
        fut = self.loop.submit(lambda e: e.abort(request_id))
        if self.stalled is not None:
            return False
        done = asyncio.wrap_future(fut)
        stall = asyncio.ensure_future(self._stall_seen.wait())
        try:
            await asyncio.wait((done, stall), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stall.cancel()
        return done.result() if done.done() else False

    def check_stall(self, timeout_s: float) -> None:
        """Mark the worker stalled once its engine thread has been busy in one step or
        function for `timeout_s` (failing every open stream with a 503), and serving
        again once the thread moved on."""
        busy = self.loop.busy_for()
        if busy >= timeout_s and self.lost is None:
            if self.stalled is None:
                self.stalled = (
                    f"engine loop stalled: no progress for {busy:.1f} s "
                    f"(stall timeout {timeout_s:g} s, step {self.loop.num_steps + 1}, "
                    f"{len(self._streams)} open streams)"
                )
                log.error("%s: failing every open request", self.stalled)
                self._stall_seen.set()
                # Calls queued behind the stuck step (adding a request, a status) fail
                # now with a 503 and never run; every open request fails too, and is
                # aborted should the step return (its client was told).
                for fut in list(self._calls):
                    fut.cancel()
                rids = list(self._streams)
                self._fail_all(EngineStalled(self.stalled))
                self.loop.submit(lambda e: [e.abort(rid) for rid in rids])
        elif busy < timeout_s and self.stalled is not None:
            log.warning("engine loop progressing again after a stall; serving")
            self.stalled = None
            self._stall_seen.clear()

    async def _watch(self, timeout_s: float) -> None:
        # A check a few times per timeout: the stall shows within ~1.25x the timeout.
        period = min(1.0, max(0.05, timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            self.check_stall(timeout_s)

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

"""EngineLoop: the one thread that drives an LLMEngine inside a worker process.

    HTTP handlers (event loop) ──submit(fn)──▶ inbox ──▶ engine thread
                                                          │ run queued fns
                                                          │ engine.step() while work exists
    per-request sinks ◀── on_output(RequestOutput) ───────┘

The engine is not thread-safe: every touch of it (add, abort, admit, status) goes through
`submit`, which runs the function in the engine thread between steps and returns a
concurrent Future. A function that raises fails only its Future; a step that raises is
reported through `on_step_error` with the requests it affected, and the loop goes on.

Heartbeat: `busy_for()` is how long the thread has been inside one step or one submitted
function (0 while it waits for work). A step that never returns (a kernel that does not
finish, a collective whose peers are wedged) shows as a growing busy time, which
enginehost/host.py turns into an unhealthy /health; the engine itself needs no hook.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Owns the engine thread, its inbox of functions and the delivery of outputs."""

    def __init__(
        self,
        engine: LLMEngine,
        on_output: Callable[[RequestOutput], None],
        on_step_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_output = on_output
        self._on_step_error = on_step_error
        self._inbox: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0
        self.busy_s = 0.0
        self._busy_since: float | None = None
        """time.monotonic() when the thread entered its current step or function; None
        while it waits for work. Written by the engine thread only, read by any."""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)

    def halt(self) -> None:
        """Stop stepping after the current step (any thread, the engine's own too)."""
        self._stop = True
        self._wake.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in its current step or submitted function
        (0.0 while idle): the loop's heartbeat, readable from any thread."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run fn(engine) in the engine thread before the next step."""
        fut: Future[T] = Future()
        self._inbox.append((fn, fut))
        self._wake.set()
        return fut

    def _drain_inbox(self) -> None:
        while self._inbox:
            fn, fut = self._inbox.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._busy_since = time.monotonic()
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                self._busy_since = None

    def _run(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            self._busy_since = time.monotonic()
            try:
                outputs = self.engine.step()
            except BaseException as e:  # a step fault must not kill the worker silently
                log.exception("engine step failed")
                if self._on_step_error is not None:
                    self._on_step_error(e)
                continue
            finally:
                self._busy_since = None
                self.busy_s += time.perf_counter() - t0
                self.num_steps += 1
            for out in outputs:
                self._on_output(out)

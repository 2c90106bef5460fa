"""Requests bound to a decode process while prefill still works on them, and what happens
to them when that process goes.

    relay: DecodeReady from decode d (incarnation i) ─▶ bind(d, i, request)
           prefill's call and first event are awaited through Binding.watch
           first token from prefill (decode has the request now) ─▶ Binding.release
    the router learns d is down:
      a connection to d refused or broken, GET /health refused or not 200
                                     (InstanceRegistry.mark_unhealthy, down=True)
      GET /health names a new incarnation (the supervisor restarted d)
                                     (InstanceRegistry.mark_healthy)
    ─▶ every binding of d's dead process is lost: its `watch` raises DecodeLost at once, the
       run fails with a 503 (retry-after), and its failure path aborts the request on
       every instance that was sent it (prefill's /abort drops it from the queue or the
       engine: no prompt is computed and sent to a landing that no longer exists)

Why fail and not re-route: the client has received nothing yet, so a retry is safe and
cheap, while a re-route inside the router would have to wait until prefill confirmed
the abort (the request keeps its id there), admit and reserve on another decode, and
send prefill again: two extra round trips for a case that lasts a supervisor restart.
A health poll that timed out does not count (a slow process is not a dead one).
Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, TypeVar

from router.errors import WorkerUnavailable

if TYPE_CHECKING:
    from router.instances import Instance

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class DecodeLost(WorkerUnavailable):
    """503: the decode instance the request was reserved on went down before prefill
    finished it (nothing was streamed yet: a retry is safe)."""


class Binding:
    """One request reserved on one decode process, waiting for prefill.

    No task of its own: while `watch` waits for prefill's first event, a loss cancels
    the task that awaits it (the request's own), and `watch` turns that
    cancellation into DecodeLost (Task.uncancel: a cancellation from elsewhere, such as
    the client leaving, still propagates)."""

    def __init__(
        self,
        owner: DecodeBindings,
        decode: Instance,
        incarnation: str,
        request_id: str,
        on_lost: Callable[[Binding], None] | None = None,
    ) -> None:
        self._owner = owner
        self.decode = decode
        self.incarnation = incarnation
        self.request_id = request_id
        self.lost_reason: str | None = None
        """Set once the decode process is known to be gone."""
        self._waiting: asyncio.Task[object] | None = None
        """The task suspended in `watch` (the one to cancel on a loss)."""
        self._cancelled = False
        self._on_lost = on_lost
        """Called once on a loss instead of cancelling a task: a run served elsewhere
        (router/edge_control.py) awaits nothing here."""

    def release(self) -> None:
        """Prefill is done with it (or the run ended): stop watching. Idempotent."""
        self._owner._drop(self)

    def lose(self, reason: str) -> None:
        """The decode process is gone: `watch` raises DecodeLost now or at its entry."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        if self._on_lost is not None:
            self._on_lost(self)
        if self._waiting is not None and not self._cancelled:
            self._cancelled = True
            self._waiting.cancel(f"decode lost: {reason}")

    async def watch(self, first: Coroutine[object, object, _T]) -> _T:
        """`first`'s result (the relay's call to prefill and its first event), or
        DecodeLost as soon as the decode process is lost (`first` is cancelled and
        unwinds first). The binding is released when `first` ends, however it ends:
        decode holds the request from prefill's first token on, and a break of decode's
        stream is the relay's to see."""
        try:
            if self.lost_reason is not None:
                first.close()
                raise self._error()
            self._waiting = asyncio.current_task()
            try:
                result = await first
            except BaseException as e:
                if not self._cancelled:
                    raise
                # our cancellation (the read may have turned it into another error)
                task = self._waiting
                if task is not None and task.uncancel() > 0:
                    raise  # cancelled from elsewhere too: that one wins
                raise self._error() from (None if isinstance(e, asyncio.CancelledError) else e)
            finally:
                self._waiting = None
            if self._cancelled:  # the read swallowed our cancellation: still lost
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise self._error()
            return result
        finally:
            self.release()

    async def guard(self, events: AsyncIterator[_T]) -> AsyncIterator[_T]:
        """`events` until they end, their first one read through `watch` (DecodeLost as
        soon as the decode process is lost while it is awaited)."""
        it = aiter(events)
        try:
            first = await self.watch(_first(it))
        except StopAsyncIteration:
            return
        yield first
        async for event in it:
            yield event

    def error(self) -> DecodeLost:
        """The client's error for a lost binding (503, retry-after)."""
        return self._error()

    def _error(self) -> DecodeLost:
        return DecodeLost(
            f"request {self.request_id}: {self.decode.describe()}, where it was reserved, "
            f"went down before prefill finished it ({self.lost_reason}); nothing was "
            "generated: retry the request",
            code="decode_instance_lost",
            headers={"retry-after": "1"},
        )


async def _first(events: AsyncIterator[_T]) -> _T:
    return await anext(events)


class DecodeBindings:
    """Owns the bindings of every decode instance (InstanceRegistry holds one)."""

    def __init__(self) -> None:
        self._by_instance: dict[str, dict[str, Binding]] = {}

    def bind(
        self,
        decode: Instance,
        incarnation: str,
        request_id: str,
        on_lost: Callable[[Binding], None] | None = None,
    ) -> Binding:
        """Bind `request_id` to `decode`'s process `incarnation`. `on_lost`: called when
        that process is lost, for a run that does not wait in `watch` (the native data
        plane's, through router/edge_control.py)."""
        b = Binding(self, decode, incarnation, request_id, on_lost)
        self._by_instance.setdefault(decode.name, {})[request_id] = b
        return b

    def num_bound(self, decode: Instance) -> int:
        return len(self._by_instance.get(decode.name, {}))

    def lose(self, decode: Instance, reason: str, incarnation: str = "") -> int:
        """`decode`'s process `incarnation` ("" = whichever) is gone: fail its bindings.
        Returns how many."""
        return self._lose(
            decode, reason, lambda b: not incarnation or b.incarnation in ("", incarnation)
        )

    def restarted(self, decode: Instance, incarnation: str) -> int:
        """`decode` now runs process `incarnation`: bindings of other processes are lost."""
        why = "it was restarted: a new process answers /health"
        return self._lose(
            decode, why, lambda b: bool(b.incarnation) and b.incarnation != incarnation
        )

    def _lose(self, decode: Instance, reason: str, match: Callable[[Binding], bool]) -> int:
        bound = self._by_instance.get(decode.name, {})
        lost = [b for b in bound.values() if match(b)]
        for b in lost:
            del bound[b.request_id]
            b.lose(reason)
        if lost:
            log.warning(
                "%s is down (%s): failing %d request(s) still waiting for prefill",
                decode.describe(),
                reason,
                len(lost),
            )
        return len(lost)

    def _drop(self, b: Binding) -> None:
        bound = self._by_instance.get(b.decode.name)
        if bound is not None and bound.get(b.request_id) is b:
            del bound[b.request_id]

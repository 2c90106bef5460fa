"""AdmissionGate: decode KV headroom in front of the serving path (DESIGN §5 step 2).

Each decode instance has a token budget = its KV capacity (GET /info) x headroom (0.9).
A request reserves prompt + max_tokens tokens on the decode instance the policy picks
among those with room, and gives them back when it ends, however it ends.

    room now, nobody waiting     -> reserve, go
    no room (or others waiting)  -> wait in line, up to wait_timeout_s
                                    -> 429 + Retry-After when it runs out
    max_waiting already waiting  -> 429 + Retry-After at once
    larger than every budget     -> 400 (it can never fit: shorten it)

Who in the line goes when KV frees is `router.admission.order` (router/admission_order.py):
"fifo" (arrival order, nobody passes the head) or "fits_first" (the first waiter that
fits passes a head that does not, until the head has waited `pass_bound_s`). A request
that arrives while others wait goes at once only when the order lets it pass them and
none of them can go.

An instance whose capacity is not known yet (its /info not read) has no budget limit: the
gate never blocks serving on the watcher. Runs on the router's event loop only.

Metrics: the router's own (router/metrics.py) —
    kvserve_router_admission_rejections_total{reason}   queue_full | wait_timeout |
                                                        kv_headroom (larger than any budget)
    kvserve_router_admission_waiting                    requests waiting now
    kvserve_router_admission_wait_seconds               time a request waited
and kvserve_router_admission_reserved_tokens{instance} (decode KV reserved now).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.admission_order import AdmissionOrder, Waiter, make_order
from router.cluster_view import ClusterView, InstanceState
from router.errors import APIError, InvalidRequest
from router.instances import Instance
from router.lean_counter import LeanGauge
from router.metrics import RouterMetrics

RECHECK_S = 0.25
"""Waiters also re-check this often (capacity learned, instances back to health, the
order's bound passed)."""
CHOICE_TTL_S = 0.05
"""The order's pick is reused this long while nothing was reserved, released, queued or
dequeued: every waiter wakes on a change, and fits_first's pick reads the whole line."""


class TooManyRequests(APIError):
    """429: the decode side has no KV headroom for the request now; retry later."""

    status = 429
    type = "rate_limit_error"


@dataclass(frozen=True)
class AdmissionSettings:
    """cluster.yaml `router.admission` (protocol/cluster.py AdmissionConfig)."""

    wait_timeout_s: float = 30.0
    headroom: float = 0.9
    max_waiting: int = 1024
    order: str = "fifo"
    pass_bound_s: float = 1.0


class Reservation:
    """Decode KV tokens held for one request on one instance; `release` is idempotent."""

    def __init__(self, gate: AdmissionGate, inst: Instance, request_id: str, tokens: int):
        self.gate = gate
        self.instance = inst
        self.request_id = request_id
        self.tokens = tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.gate._release(self)


class AdmissionGate:
    """Owns the line of waiting requests (in arrival order; the order picks who goes) and
    the decode reservations (kept in the ClusterView, where the decode policy sees them
    too)."""

    def __init__(
        self,
        view: ClusterView,
        settings: AdmissionSettings,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.view = view
        self.settings = settings
        self.order: AdmissionOrder = make_order(settings.order, settings.pass_bound_s)
        self._waiters: deque[Waiter] = deque()
        self._changed = asyncio.Event()
        self._generation = 0
        """Bumped on every reservation, release, and change of the line."""
        self._choice: tuple[int, float, Waiter | None] = (-1, 0.0, None)
        self.metrics = metrics or RouterMetrics()
        self.reserved = LeanGauge(  # set twice per request: no lock (router/lean_counter.py)
            "kvserve_router_admission_reserved_tokens",
            "Decode KV tokens reserved by the admission gate",
            ("instance",),
            self.metrics.registry,
        )

    def budget(self, inst: Instance) -> int | None:
        """Tokens the gate may hand out on `inst`; None when its capacity is unknown."""
        return self._budget_of(self.view.state(inst))

    def _budget_of(self, st: InstanceState) -> int | None:
        info = st.info
        if info is None:
            return None
        return int(info.kv_capacity_tokens * self.settings.headroom)

    def fits(self, inst: Instance, tokens: int) -> bool:
        budget = self.budget(inst)
        return budget is None or self.view.state(inst).reserved_tokens + tokens <= budget

    async def admit(
        self,
        request_id: str,
        tokens: int,
        candidates: Callable[[], Sequence[Instance]],
        choose: Callable[[Sequence[Instance]], Instance],
    ) -> Reservation:
        """Reserve `tokens` on the instance `choose` picks among `candidates()` with room.
        Raises TooManyRequests (429) or InvalidRequest (400) as the module doc says;
        `candidates` raises itself when no instance is routable at all."""
        t0 = time.monotonic()
        now = self.admit_now(request_id, tokens, candidates, choose)
        if now is not None:
            return now
        return await self._wait(request_id, tokens, candidates, choose, t0)

    def admit_now(
        self,
        request_id: str,
        tokens: int,
        candidates: Callable[[], Sequence[Instance]],
        choose: Callable[[Sequence[Instance]], Instance],
    ) -> Reservation | None:
        """`admit` without waiting: the reservation when nobody waits and an instance has
        room, else None (the caller then awaits `admit`). Raises as `admit` does for a
        request no budget can hold."""
        # One pass over the candidates: each one's budget and room read once.
        room: list[Instance] = []
        largest: int | None = None
        too_large = True  # for every candidate (none when one's budget is unknown)
        view = self.view
        cands = candidates()
        for inst in cands:
            st = view.state(inst)
            budget = self._budget_of(st)
            if budget is None:
                too_large = False
                room.append(inst)
                continue
            if tokens <= budget:
                too_large = False
            if largest is None or budget > largest:
                largest = budget
            if st.reserved_tokens + tokens <= budget:
                room.append(inst)
        if cands and too_large:
            self.metrics.on_rejected("kv_headroom")
            raise InvalidRequest(
                f"the request needs decode KV for {tokens} tokens (prompt + max_tokens) but "
                f"the largest decode budget is {largest} tokens; shorten the prompt or "
                "max_tokens",
                code="kv_budget_exceeded",
            )
        if (not self._waiters or self._may_pass(time.monotonic())) and room:
            self.metrics.admission_wait.observe(0.0)
            return self._reserve(choose(room), request_id, tokens)
        return None

    def _may_pass(self, now: float) -> bool:
        """A newcomer may go ahead of the line: the order allows it and nobody in line can
        go now (else the one who can would lose its turn to the newcomer)."""
        return self.order.lets_pass(self._waiters, now) and self._next_to_go(now) is None

    def _next_to_go(self, now: float) -> Waiter | None:
        generation, at, choice = self._choice
        if generation == self._generation and now - at < CHOICE_TTL_S:
            return choice
        choice = self.order.next_to_go(self._waiters, now)
        if choice is not None and choice is not self._choice[2]:
            self._notify()  # picked on a re-check (capacity learned, the bound passed)
        self._choice = (self._generation, now, choice)
        return choice

    def _has_room(self, tokens: int, candidates: Callable[[], Sequence[Instance]]) -> bool:
        try:
            cands = candidates()
        except APIError:  # nothing routable for it now: that request itself will say so
            return False
        return any(self.fits(i, tokens) for i in cands)

    async def _wait(
        self,
        request_id: str,
        tokens: int,
        candidates: Callable[[], Sequence[Instance]],
        choose: Callable[[Sequence[Instance]], Instance],
        t0: float,
    ) -> Reservation:
        """Wait in line until the order picks this request and an instance has room, or
        time out."""
        if len(self._waiters) >= self.settings.max_waiting:
            self.metrics.on_rejected("queue_full")
            raise self._busy(f"{len(self._waiters)} requests are already waiting")
        waiter = Waiter(request_id, tokens, t0, lambda: self._has_room(tokens, candidates))
        self._waiters.append(waiter)
        self._generation += 1
        self.metrics.admission_waiting.inc()
        deadline = t0 + self.settings.wait_timeout_s
        try:
            while True:
                if self._waiters[0] is waiter:
                    candidates()  # raises when no instance is routable at all
                if self._next_to_go(time.monotonic()) is waiter:
                    room = [i for i in candidates() if self.fits(i, tokens)]
                    if room:
                        self.metrics.admission_wait.observe(time.monotonic() - t0)
                        return self._reserve(choose(room), request_id, tokens)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.on_rejected("wait_timeout")
                    self.metrics.admission_wait.observe(time.monotonic() - t0)
                    raise self._busy(
                        f"no decode instance had KV headroom for {tokens} tokens within "
                        f"{self.settings.wait_timeout_s:g} s (router.admission.wait_timeout_s)"
                    )
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, RECHECK_S))
        finally:
            self._waiters.remove(waiter)
            self._generation += 1
            self.metrics.admission_waiting.dec()
            self._notify()  # the next in line may go now

    def _busy(self, why: str) -> TooManyRequests:
        retry = max(1, math.ceil(self.settings.wait_timeout_s / 6))
        return TooManyRequests(
            f"the server is at its decode KV capacity: {why}; retry after {retry} s",
            code="kv_capacity_exceeded",
            headers={"retry-after": str(retry)},
        )

    def _reserve(self, inst: Instance, request_id: str, tokens: int) -> Reservation:
        st = self.view.state(inst)
        st.reserved[request_id] = st.reserved.get(request_id, 0) + tokens
        self._generation += 1
        self.reserved.labels(inst.name).set(st.reserved_tokens)
        return Reservation(self, inst, request_id, tokens)

    def _release(self, res: Reservation) -> None:
        st = self.view.state(res.instance)
        left = st.reserved.get(res.request_id, 0) - res.tokens
        if left > 0:
            st.reserved[res.request_id] = left
        else:
            st.reserved.pop(res.request_id, None)
        self._generation += 1
        self.reserved.labels(res.instance.name).set(st.reserved_tokens)
        self._notify()

    def _notify(self) -> None:
        """Wake every waiter (each re-checks whether the order picks it and it fits)."""
        if not self._waiters:
            return  # nobody waits on the event (a waiter is in line while it waits)
        self._changed.set()
        self._changed = asyncio.Event()

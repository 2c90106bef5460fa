"""Who the admission gate (router/admission.py) admits next when decode KV frees:
cluster.yaml `router.admission.order`.

    fifo        arrival order: the head of the line waits for room and nobody passes it
                (a large request at the head holds back smaller ones that would fit)
    fits_first  the first waiter in arrival order that fits goes, passing a head that
                does not; once the head has waited `pass_bound_s`, arrival order again
                until it is admitted: nobody is passed over for longer than the bound
                (plus the time the requests ahead of it take to be admitted)

benchmarks/pool_policy_sim.py --gates models both (`fifo`, `fits:BOUND`; docs/benchmarks.md
"The admission gate and the landing room"). Runs on the router's event loop only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ORDER_NAMES = ("fifo", "fits_first")


@dataclass(eq=False)
class Waiter:
    """One request in the gate's line: what it needs and since when it waits."""

    request_id: str
    tokens: int
    since_s: float
    """time.monotonic() when it joined the line."""
    has_room: Callable[[], bool]
    """Whether an instance it may use has room for `tokens` now (reads the reservations;
    False when no instance is routable for it)."""


class AdmissionOrder(ABC):
    """Picks among the waiting line; mutates nothing."""

    name: str

    @abstractmethod
    def next_to_go(self, line: Sequence[Waiter], now_s: float) -> Waiter | None:
        """The waiter that takes the next reservation now (it has room), or None when
        nobody may go now. `line` is in arrival order."""

    @abstractmethod
    def lets_pass(self, line: Sequence[Waiter], now_s: float) -> bool:
        """Whether a request that just arrived may be admitted at once, ahead of `line`,
        when it fits and nobody in `line` may go (`next_to_go` is None)."""


class FifoOrder(AdmissionOrder):
    name = "fifo"

    def next_to_go(self, line: Sequence[Waiter], now_s: float) -> Waiter | None:
        if line and line[0].has_room():
            return line[0]
        return None

    def lets_pass(self, line: Sequence[Waiter], now_s: float) -> bool:
        return not line


class FitsFirstOrder(AdmissionOrder):
    name = "fits_first"

    def __init__(self, pass_bound_s: float) -> None:
        self.pass_bound_s = pass_bound_s

    def _head_overdue(self, line: Sequence[Waiter], now_s: float) -> bool:
        return bool(line) and now_s - line[0].since_s >= self.pass_bound_s

    def next_to_go(self, line: Sequence[Waiter], now_s: float) -> Waiter | None:
        if self._head_overdue(line, now_s):
            return line[0] if line[0].has_room() else None
        for w in line:
            if w.has_room():
                return w
        return None

    def lets_pass(self, line: Sequence[Waiter], now_s: float) -> bool:
        return not self._head_overdue(line, now_s)


def make_order(name: str, pass_bound_s: float) -> AdmissionOrder:
    """The order named `name` (one of ORDER_NAMES)."""
    if name == "fifo":
        return FifoOrder()
    if name == "fits_first":
        return FitsFirstOrder(pass_bound_s)
    raise ValueError(f"admission order must be one of {ORDER_NAMES}, got {name!r}")

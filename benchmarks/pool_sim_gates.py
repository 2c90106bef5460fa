"""The two gates in front of the prefill queue, for the pool simulator's step model
(benchmarks/pool_sim_queue.py): the router's admission gate over decode KV
(router/admission.py) and decode's landing arena (transfer/landing.py).

    arrival ─▶ admission gate ─▶ landing arena ─▶ prefill queue ─▶ first token ─▶ decode
               reserve prompt +  a region of       (the engine's     (output x ITL)
               max_tokens of     min(prompt KV,     steps)
               decode KV         landing_region)
               held ──────────────────────────────────────────────────────────────▶ end
                                 held ─────────────────────────────▶ landed

Admission orders (`Model.gate`, router.admission.order):

    fifo      strict arrival order: the head waits for room and nobody passes it (built
              before router.admission.order)
    fits      the first waiter in arrival order that fits goes; once the head has waited
              `gate_bound_s` nobody passes it (fits_first)
    smallest  the smallest waiter that fits goes, with the same bound
    late      no reservation at arrival: the decode KV is reserved when the prefill engine
              admits the request (its prefill about to start), held to its end; a request
              waiting for prefill holds none (not built: decode's engine reserves its pages
              at /decode, before prefill is called)
    off       no gate (decode KV never short)

The landing arena is first come, first served over bytes (regions of one size mostly: a
prompt of more than landing_region streams through its region); a region is held from
the landing grant (/decode) until the prompt has landed, `handoff_s` after the prefill's
last step. What the model leaves out: decode's step time growing with its batch (ITL is a
constant), decode's own prefix cache (the gate reserves the whole prompt either way), the
arena's fragmentation, and round trips between router, decode and prefill.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from benchmarks.pool_sim_cache import TOKEN_BYTES

if TYPE_CHECKING:
    from benchmarks.pool_sim_queue import Job
    from benchmarks.pool_sim_replay import Model

GATE_ORDERS = ("off", "fifo", "fits", "smallest", "late")
ALIGN_BYTES = 4096


@dataclass
class GateTimes:
    """One request's way through the gates (seconds)."""

    arrive: float
    admitted: float = 0.0
    landed_grant: float = 0.0
    need_tokens: int = 0
    region_bytes: int = 0


@dataclass
class GateStats:
    """Per-request waits: the admission gate, the landing arena, prefill received → first
    token (the three means the serving run prints)."""

    admission_s: list[float] = field(default_factory=list)
    landing_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    max_reserved: int = 0


class KVGate:
    """Decode KV tokens of one decode instance handed out by the router's gate."""

    def __init__(self, budget_tokens: int, order: str, bound_s: float) -> None:
        self.budget = budget_tokens
        self.order = order
        self.bound_s = bound_s
        self.reserved = 0
        self.waiting: list[Job] = []  # arrival order

    def fits(self, need: int) -> bool:
        return self.reserved + need <= self.budget

    def next_to_go(self, now: float) -> Job | None:
        """Who the gate admits now, if anyone (the order's rule)."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        overdue = now - head.gate.arrive >= self.bound_s
        if self.order == "fifo" or overdue:
            return head if self.fits(head.gate.need_tokens) else None
        room = [j for j in self.waiting if self.fits(j.gate.need_tokens)]
        if not room:
            return None
        if self.order == "smallest":
            return min(room, key=lambda j: (j.gate.need_tokens, j.seq))
        return room[0]

    def reserve(self, need: int, stats: GateStats) -> None:
        self.reserved += need
        stats.max_reserved = max(stats.max_reserved, self.reserved)


class LandingSim:
    """Decode's landing arena: bytes handed out first come, first served."""

    def __init__(self, total_bytes: int, region_bytes: int) -> None:
        self.total = total_bytes
        self.region_max = min(region_bytes, total_bytes)
        self.used = 0
        self.waiting: deque[Job] = deque()

    def region(self, prompt_tokens: int) -> int:
        nbytes = -(-max(prompt_tokens * TOKEN_BYTES, 1) // ALIGN_BYTES) * ALIGN_BYTES
        return min(nbytes, self.region_max)


class Gates:
    """Both gates over time: `arrive` a request, `advance(now)` to the requests that reach
    the prefill queue by `now`, `prefilled` when a prefill ends (frees the landing after
    the handoff, the reservation after the decode)."""

    def __init__(self, m: Model) -> None:
        self.m = m
        budget = int(m.decode_kv_tokens * m.gate_headroom)
        self.kv = KVGate(budget, m.gate, m.gate_bound_s)
        self.landing = LandingSim(m.landing_bytes, m.landing_region_bytes)
        self.stats = GateStats()
        self._events: list[tuple[float, int, str, Job]] = []
        self._seq = 0
        self._out: list[tuple[float, Job]] = []

    def _push(self, t: float, kind: str, job: Job) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, job))
        self._seq += 1

    def next_time(self) -> float | None:
        return self._events[0][0] if self._events else None

    def arrive(self, job: Job, t: float) -> None:
        need = job.s.req.input_length + job.s.req.output_length
        if need > self.kv.budget and self.m.gate not in ("off",):
            raise ValueError(f"a request needs {need} tokens, over the gate's {self.kv.budget}")
        job.gate.need_tokens = need
        job.gate.region_bytes = self.landing.region(job.s.req.input_length)
        self._push(t, "arrive", job)

    def advance(self, now: float) -> list[tuple[float, Job]]:
        """Process every event up to `now`; the requests granted landing, with the time."""
        while self._events and self._events[0][0] <= now:
            t, _, kind, job = heapq.heappop(self._events)
            if kind == "arrive":
                if self.m.gate in ("off", "late"):
                    self._admitted(job, t)
                else:
                    self.kv.waiting.append(job)
            elif kind == "kv_free":
                self.kv.reserved -= job.gate.need_tokens
            elif kind == "land_free":
                self.landing.used -= job.gate.region_bytes
            self._grant(t)
        out, self._out = self._out, []
        return out

    def _grant(self, t: float) -> None:
        if self.m.gate not in ("off", "late"):
            while (job := self.kv.next_to_go(t)) is not None:
                self.kv.waiting.remove(job)
                self.kv.reserve(job.gate.need_tokens, self.stats)
                self._admitted(job, t)
        land = self.landing
        while land.waiting and land.used + land.waiting[0].gate.region_bytes <= land.total:
            job = land.waiting.popleft()
            land.used += job.gate.region_bytes
            job.gate.landed_grant = t
            self.stats.landing_s.append(t - job.gate.admitted)
            self._out.append((t, job))

    def _admitted(self, job: Job, t: float) -> None:
        job.gate.admitted = t
        self.stats.admission_s.append(t - job.gate.arrive)
        self.landing.waiting.append(job)

    def may_start(self, job: Job, now: float) -> bool:
        """late: the prefill engine admits the request only with its decode KV reserved."""
        if self.m.gate != "late":
            return True
        if not self.kv.fits(job.gate.need_tokens):
            return False
        self.kv.reserve(job.gate.need_tokens, self.stats)
        return True

    def prefilled(self, job: Job, first_token: float, decode_end: float) -> None:
        self.stats.prefill_s.append(first_token - job.gate.landed_grant)
        self.stats.e2e_s.append(decode_end - job.gate.arrive)
        self._push(first_token + self.m.handoff_s, "land_free", job)
        if self.m.gate != "off":
            self._push(decode_end, "kv_free", job)

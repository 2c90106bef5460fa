"""The prefill instance as the engine runs it, for the pool simulator
(benchmarks/pool_policy_sim.py): steps of a token budget, chunked prefill, admission
that matches the prefix first, pool restores that take no budget, and a step's cost from
its tokens and their context. Disciplines (`Model.queue`); fcfs and shortest are what
engine/prefill_order.py builds:

    fcfs    running prefills in admission order, each taking what the budget leaves;
            waiting requests admitted front first while budget is left (what the engine
            did before `cache.prefill_order`)
    srpf    running prefills and waiting requests in one order: the fewest tokens left
            first (a waiting request's estimated when it arrived: its GPU prefix and
            the pool's answer, matched without admitting it), less `aging_tokens` per
            step since the request arrived; a waiting request is admitted when its turn
            comes with budget left. The bound: a request that arrived k steps after
            another overtakes it only with aging_tokens x k fewer tokens left.
    shortest  srpf with no aging and a hard bound instead: a request `bound_steps` steps
            after its arrival goes before every request under the bound (oldest first)
    cap     fcfs, but a request takes at most `chunk_cap` tokens of a step while another
            wants tokens; what is left goes back in admission order

A step of requests i with n_i new tokens over c_i tokens of context costs
    step_share x sum_i (step_token_s x n_i + step_pair_s x n_i x (c_i + n_i / 2))
    + step_overhead_s,
the H200 figures of the GPU engine (8K new tokens: 0.21 s with no prefix, 0.97 s over
56K), step_share calibrated on the measured run (decode shares the GPU). What the model
leaves out: decode steps (a fixed ITL after the first token), GPU memory (requests never
wait for blocks or get preempted), the time a restore takes from the GPU.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from benchmarks.agentic.trace import CeilingCounter, Trace
from benchmarks.pool_sim_cache import CHUNK_TOKENS
from benchmarks.pool_sim_gates import GATE_ORDERS, Gates, GateTimes
from benchmarks.pool_sim_replay import Model, Policy, Result, Reuse, Served, Threads

DISCIPLINES = ("fcfs", "srpf", "shortest", "cap")


@dataclass
class Job:
    """One request in the prefill instance."""

    s: Served
    key: str
    index: int
    arrive_step: int
    seq: int
    start: float = 0.0
    ready_at: float = 0.0
    done: int = 0
    estimate: int = 0
    chunk_done: list[float] = field(default_factory=list)
    gate: GateTimes = field(default_factory=lambda: GateTimes(0.0))

    @property
    def base(self) -> int:
        return self.s.gpu_tok + self.s.pool_tok

    @property
    def remaining(self) -> int:
        return self.s.computed - self.done


class StepQueue:
    """Waiting, loading and running requests; `plan` picks a step's work."""

    def __init__(self, m: Model, reuse: Reuse, gates: Gates | None = None) -> None:
        self.m, self.reuse, self.gates = m, reuse, gates
        self.waiting: deque[Job] = deque()
        self.loading: list[Job] = []
        self.running: list[Job] = []
        self.steps = 0

    def busy(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def _admit(self, job: Job, now: float) -> bool:
        """Match the prefix; True when the request runs now (no restore to wait for)."""
        self.reuse.lookup(job.s, now)
        job.start = now
        if job.s.pool_tok:
            job.ready_at = now + self.reuse.restore_s(job.s)
            self.loading.append(job)
            return False
        self.running.append(job)
        return True

    def _may_start(self, job: Job, now: float) -> bool:
        return self.gates is None or self.gates.may_start(job, now)

    def _loaded(self, now: float) -> None:
        for job in [j for j in self.loading if j.ready_at <= now]:
            self.loading.remove(job)
            self.running.append(job)  # joins at the end, as a finished load does

    def plan(self, now: float) -> list[tuple[Job, int]]:
        self._loaded(now)
        m = self.m
        budget = m.step_tokens
        take: dict[int, int] = {}
        order: list[Job]
        if m.queue in ("srpf", "shortest"):
            age = m.aging_tokens if m.queue == "srpf" else 0.0
            bound = m.bound_steps if m.queue == "shortest" else None
            running = set(id(j) for j in self.running)

            def key(j: Job) -> tuple[int, float, int]:
                waited = self.steps - j.arrive_step
                if bound is not None and waited >= bound:
                    return (0, j.arrive_step, j.seq)  # past the bound: by arrival, first
                left = j.remaining if id(j) in running else j.estimate
                return (1, left - age * waited, j.seq)

            order = []
            for j in sorted(self.running + list(self.waiting), key=key):
                if budget == 0:
                    break
                if id(j) not in running:
                    if len(self.running) + len(self.loading) >= m.max_seqs:
                        continue
                    if not self._may_start(j, now):
                        continue
                    self.waiting.remove(j)
                    if not self._admit(j, now):
                        continue
                n = min(j.remaining, budget)
                take[j.seq] = n
                budget -= n
                order.append(j)
        else:
            cap = m.chunk_cap if m.queue == "cap" else m.step_tokens
            order = list(self.running)
            for j in order:
                n = min(j.remaining, budget, cap)
                if n:
                    take[j.seq] = n
                    budget -= n
            while self.waiting and budget > 0:
                if len(self.running) + len(self.loading) >= m.max_seqs:
                    break
                if not self._may_start(self.waiting[0], now):
                    break
                job = self.waiting.popleft()
                if self._admit(job, now):
                    n = min(job.remaining, budget, cap)
                    take[job.seq] = n
                    budget -= n
                    order.append(job)
            for j in order:  # cap: what is left goes back in admission order
                if budget == 0:
                    break
                extra = min(j.remaining - take.get(j.seq, 0), budget)
                if extra > 0:
                    take[j.seq] = take.get(j.seq, 0) + extra
                    budget -= extra
        return [(j, take[j.seq]) for j in order if take.get(j.seq)]

    def cost(self, work: list[tuple[Job, int]]) -> float:
        m = self.m
        t = 0.0
        for j, n in work:
            ctx = j.base + j.done
            t += m.step_token_s * n + m.step_pair_s * n * (ctx + n / 2)
        return m.step_share * t + m.step_overhead_s


def simulate_steps(trace: Trace, policy: Policy, m: Model, seed: int = 0) -> Result:
    if m.queue not in DISCIPLINES:
        raise ValueError(f"queue must be server or one of {DISCIPLINES}, got {m.queue!r}")
    if m.gate is not None and m.gate not in GATE_ORDERS:
        raise ValueError(f"gate must be None or one of {GATE_ORDERS}, got {m.gate!r}")
    res = Result()
    ceiling = CeilingCounter(trace.block_tokens)
    reuse = Reuse(trace, policy, m, seed, res)
    threads = Threads(trace, m, seed, ceiling)
    gates = Gates(m) if m.gate is not None else None
    q = StepQueue(m, reuse, gates)
    arrivals: list[tuple[float, int, Job]] = []
    seq = 0
    now = 0.0
    while True:
        while threads.ready and threads.ready[0][0] <= now:
            got = threads.pop()
            if got is not None:
                key, i, req, arrive = got
                job = Job(reuse.served(req, arrive), key, i, 0, seq, gate=GateTimes(arrive))
                if gates is not None:
                    gates.arrive(job, arrive)
                else:
                    heapq.heappush(arrivals, (arrive, seq, job))
                seq += 1
        if gates is not None:
            for t, job in gates.advance(now):
                heapq.heappush(arrivals, (t, job.seq, job))
        while arrivals and arrivals[0][0] <= now:
            _, _, job = heapq.heappop(arrivals)
            job.arrive_step = q.steps
            job.estimate = reuse.peek(job.s)
            q.waiting.append(job)
        work = q.plan(now)
        if not work:
            nxt = [j.ready_at for j in q.loading]
            if threads.ready:
                nxt.append(threads.ready[0][0])
            if arrivals:
                nxt.append(arrivals[0][0])
            if gates is not None and (t := gates.next_time()) is not None:
                nxt.append(t)
            if not nxt:
                break
            now = max(now, min(nxt))
            continue
        end = now + q.cost(work)
        q.steps += 1
        res.steps += 1
        res.busy_s += end - now
        for j, n in work:
            before = j.base + j.done
            j.done += n
            after = j.base + j.done
            for _ in range(before // CHUNK_TOKENS, after // CHUNK_TOKENS):
                j.chunk_done.append(end)
            if j.remaining == 0:
                q.running.remove(j)
                reuse.store(j.s, j.start, end, j.chunk_done)
                reuse.done(j.s, end)
                decode_end = end + j.s.req.output_length * m.itl_s
                if gates is not None:  # decode runs once the whole prompt has landed
                    decode_end += m.handoff_s
                    gates.prefilled(j, end, decode_end)
                threads.answered(j.key, j.index, decode_end)
        now = end
    res.ceiling = ceiling.ceiling
    if gates is not None:
        res.gates = gates.stats
        assert not gates.kv.waiting and gates.kv.reserved == 0, "the gate leaked"
    return res

"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Contract of `schedule()`: every request has num_computed_tokens catching up to num_tokens;
a step gives each chosen request some new tokens to compute, within a token budget of
max_num_batched_tokens, in the prefill order (engine/prefill_order.py). `fcfs`: running
requests go first, in admission order (decodes take one token, unfinished prefills take
what the budget leaves); waiting requests are admitted after, front first, each starting
from its longest cached prefix. `shortest`: decodes first, then running prefills and
waiting requests by the tokens they have left (a waiting request's estimated before
admission), a request past the bound first. The admission rule (engine/admission.py)
decides whether a waiting request may start: `chunk` when the blocks of the chunk it is
given are free, `whole_prompt` only when its whole prompt fits beside what the admitted
requests still lack; a request it refuses stays waiting and, as when blocks are short,
nothing more is admitted this step. When blocks run short the most recently
admitted running request not yet given tokens this step is preempted: its blocks are
freed, its progress reset to 0 (recompute; its output tokens are kept), and it goes back
to the front of the waiting queue. Nothing else is mutated; `update` applies a step's
results.

With a KV connector (engine/kv_connector.py, the scheduler side), admission also asks
how many tokens after the GPU prefix the connector provides; for an asynchronous load the
request gets its blocks, the connector plans the load, and the request waits in `loading`
(status WAITING_FOR_KV) without taking token budget; it counts against max_num_seqs.
Every schedule() ends with the connector's metadata of the step (`kv_meta`); the engine
hands the workers' reports back through `update_from_connector`: a loaded request joins
`running` at the end, from its GPU prefix plus the tokens actually loaded. Whenever blocks
are about to be freed (finish, abort, preemption) the connector may keep them (`held`)
until it reports them released: a transfer may still read or write them.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from engine.admission import Admission, ChunkAdmission
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    NoConnectorScheduler,
    StepKV,
)
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from protocol.ids import BlockId, RequestId


class _Admitted(enum.Enum):
    UNDECIDED = "undecided"
    """The connector is still looking: stays waiting, asked again next step."""
    NO_BLOCKS = "no_blocks"
    """Blocks are short: stays waiting, nothing more admitted this step."""
    LOADING = "loading"
    SCHEDULED = "scheduled"


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step brings the request level with its tokens, so its last logits are
        sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_meta: bytes = b""
    """The KV connector's metadata of this step, for every worker (b"" for none)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerCounters:
    """Prompt tokens by source (counted once per request, at first admission) and events.
    prompt_tokens_cached is the GPU prefix cache, prompt_tokens_pool the KVConnector."""

    prompt_tokens_cached: int = 0
    prompt_tokens_pool: int = 0
    prompt_tokens_computed: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    """Tokens a preempted request had computed that its readmission computes again (not
    found in the GPU prefix cache or loaded by the connector)."""
    loads_started: int = 0
    loads_short: int = 0
    """Loads that brought fewer tokens than matched (failed or partial: recomputed)."""
    admissions_deferred: int = 0
    """Steps whose admission stopped at a request the admission rule kept waiting (its
    prompt does not fit beside what is admitted: engine/admission.py)."""


class Scheduler:
    """Owns the waiting queue, the running list and the requests loading external KV;
    decides each step's work."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        connector: KVConnectorScheduler | None = None,
        order: PrefillOrder | None = None,
        admission: Admission | None = None,
    ):
        self.kv = kv
        self.order = order or PrefillOrder()
        self.admission: Admission = admission or ChunkAdmission()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.connector: KVConnectorScheduler = connector or NoConnectorScheduler()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[RequestId, Request] = {}
        """WAITING_FOR_KV requests, by id; _load_span has each one's [start, end)."""
        self.held: dict[RequestId, list[list[BlockId]]] = {}
        """Block tables of finished or preempted requests that the connector still uses,
        freed when it reports the request released."""
        self._load_span: dict[RequestId, tuple[int, int]] = {}
        self.paused: set[RequestId] = set()
        """Running requests not to schedule now: a pipelined engine's requests whose
        sampled token is still on its way back (engine/parallel/pp_engine.py)."""
        self.counters = SchedulerCounters()
        self.steps = 0
        """schedule() calls so far: the clock of the prefill order's bound."""
        self._arrived: dict[RequestId, int] = {}
        self._estimate: dict[RequestId, int] = {}
        """shortest: a waiting request's tokens left, estimated before admission."""
        self._lost: dict[RequestId, int] = {}
        """A preempted request's tokens computed before its preemption: what its next
        admission computes again, less its prefix hit and load (recomputed_tokens)."""

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._arrived[request.request_id] = self.steps

    def add_running(self, request: Request) -> None:
        """Adopt a request whose KV is already in place (decode after a handoff)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._arrived[request.request_id] = self.steps

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.held)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule()
        out.kv_meta = self.connector.build_step_meta(
            [
                StepKV(
                    s.request,
                    s.request.num_computed_tokens,
                    s.request.num_computed_tokens + s.num_new_tokens,
                    list(self.kv.block_table(s.request.request_id)),
                )
                for s in out.scheduled
            ]
        )
        return out

    def _schedule(self) -> SchedulerOutput:
        self.steps += 1
        if self.order.kind == "shortest":
            return self._schedule_shortest()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        given: set[RequestId] = set()
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in self.paused:
                continue  # preempted earlier in this loop, or waiting for its token
            budget -= self._give(req, budget, given, out)
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        undecided: list[Request] = []
        while self.waiting and budget > 0 and self._num_seqs() < self.max_num_seqs:
            req = self.waiting.popleft()
            admitted, n = self._admit(req, budget, given, out)
            if admitted is _Admitted.UNDECIDED:  # the connector is still looking: the next one
                undecided.append(req)
            elif admitted is _Admitted.NO_BLOCKS:
                self.waiting.appendleft(req)
                break
            budget -= n
        self.waiting.extendleft(reversed(undecided))  # back in front, in their order
        return out

    def _schedule_shortest(self) -> SchedulerOutput:
        """Decodes first, then prefills and waiting requests by the tokens they have left
        (engine/prefill_order.py); waiting ones are admitted when their turn comes."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        given: set[RequestId] = set()
        runnable = [
            r
            for r in self.running
            if r.status is RequestStatus.RUNNING and r.request_id not in self.paused
        ]
        decodes = [r for r in runnable if r.num_tokens - r.num_computed_tokens <= 1]
        prefills = [r for r in runnable if r.num_tokens - r.num_computed_tokens > 1]
        running_ids = {r.request_id for r in runnable}
        ranked = sorted(prefills + list(self.waiting), key=self._rank)
        admitting = True
        for req in decodes + ranked:
            if budget == 0:
                break
            if req.request_id in running_ids:
                if req.status is RequestStatus.RUNNING:  # else preempted earlier this step
                    budget -= self._give(req, budget, given, out)
                continue
            if not admitting or out.preempted or self._num_seqs() >= self.max_num_seqs:
                continue  # memory or sequences are short: admit nothing more this step
            if req.status is not RequestStatus.WAITING or req not in self.waiting:
                continue
            admitted, n = self._admit(req, budget, given, out)
            if admitted is _Admitted.NO_BLOCKS:
                admitting = False
            elif admitted is not _Admitted.UNDECIDED:
                self.waiting.remove(req)
                budget -= n
        return out

    def _rank(self, req: Request) -> tuple[int, int, int]:
        """shortest's order: past the bound first (oldest first), then the fewest tokens
        left (ties: the oldest)."""
        arrived = self._arrived.get(req.request_id, self.steps)
        if self.steps - arrived >= self.order.bound_steps:
            return (0, arrived, 0)
        if req.status is RequestStatus.RUNNING:
            left = req.num_tokens - req.num_computed_tokens
        else:
            left = self._estimate_left(req)
        return (1, left, arrived)

    def _estimate_left(self, req: Request) -> int:
        """A waiting request's tokens left to compute after its GPU prefix and what the
        connector provides, asked once (again while the connector is still looking)."""
        known = self._estimate.get(req.request_id)
        if known is not None:
            return known
        prefix = self.kv.find_prefix(req)
        # Asking before admission is what a request waiting for blocks does every step:
        # the connectors answer from their lookup and change nothing until
        # update_state_after_alloc.
        num_external, _ = self.connector.get_num_new_matched_tokens(req, prefix.num_tokens)
        left = req.num_tokens - prefix.num_tokens - (num_external or 0)
        if num_external is not None:
            self._estimate[req.request_id] = left
        return left

    def _give(self, req: Request, budget: int, given: set[RequestId], out: SchedulerOutput) -> int:
        """Schedule running `req` for what the budget allows, preempting the most recently
        admitted running request not given tokens this step while blocks are short (`req`
        itself last). Returns the tokens given (0 when `req` was preempted)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        while not self.kv.allocate_slots(req, n):
            victim = next(r for r in reversed(self.running) if r.request_id not in given)
            self._preempt(victim, out)
            if victim is req:
                return 0
        out.scheduled.append(ScheduledRequest(req, n))
        given.add(req.request_id)
        return n

    def _admit(
        self, req: Request, budget: int, given: set[RequestId], out: SchedulerOutput
    ) -> tuple[_Admitted, int]:
        """Admit waiting `req` (the caller takes it out of the queue unless UNDECIDED or
        NO_BLOCKS): match its prefix, ask the connector, allocate. Returns what happened
        and the tokens scheduled."""
        prefix = self.kv.find_prefix(req)
        num_external, is_async = self.connector.get_num_new_matched_tokens(req, prefix.num_tokens)
        if num_external is None:
            return _Admitted.UNDECIDED, 0
        if not self.admission.admits(self.kv, req, prefix, [*self.running, *self.loading.values()]):
            self.counters.admissions_deferred += 1
            return _Admitted.NO_BLOCKS, 0
        self._estimate.pop(req.request_id, None)
        if num_external > 0 and is_async:
            if not self.kv.allocate_slots(req, num_external, prefix):
                return _Admitted.NO_BLOCKS, 0
            self._start_load(req, prefix.num_tokens, num_external)
            return _Admitted.LOADING, 0
        start = prefix.num_tokens + num_external
        n = min(req.num_tokens - start, budget)
        if not self.kv.allocate_slots(req, num_external + n, prefix):
            return _Admitted.NO_BLOCKS, 0
        req.num_computed_tokens = prefix.num_tokens
        self.connector.update_state_after_alloc(
            req, list(self.kv.block_table(req.request_id)), num_external
        )
        req.num_computed_tokens = start  # external tokens land before this forward
        self._run(req, prefix.num_tokens, num_external)
        if num_external:
            self.counters.loads_started += 1
        out.scheduled.append(ScheduledRequest(req, n))
        given.add(req.request_id)
        return _Admitted.SCHEDULED, n

    def _num_seqs(self) -> int:
        return len(self.running) + len(self.loading)

    def _run(self, req: Request, num_gpu_tokens: int, num_pool_tokens: int) -> None:
        """Make an admitted request running; count its prompt tokens at first admission."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.num_cached_prompt_tokens is None:
            cached = min(num_gpu_tokens, req.num_prompt_tokens)
            pool = min(num_pool_tokens, req.num_prompt_tokens - cached)
            req.num_cached_prompt_tokens = cached
            req.num_pool_prompt_tokens = pool
            self.counters.prompt_tokens_cached += cached
            self.counters.prompt_tokens_pool += pool
            self.counters.prompt_tokens_computed += req.num_prompt_tokens - cached - pool
        else:  # after a preemption: only what was computed and is not found again counts
            lost = self._lost.pop(req.request_id, 0)
            self.counters.recomputed_tokens += max(0, lost - req.num_computed_tokens)

    def _start_load(self, req: Request, num_prefix_tokens: int, num_external: int) -> None:
        req.num_computed_tokens = num_prefix_tokens
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[req.request_id] = req
        end = num_prefix_tokens + num_external
        self._load_span[req.request_id] = (num_prefix_tokens, end)
        self.counters.loads_started += 1
        table = list(self.kv.block_table(req.request_id))
        self.connector.update_state_after_alloc(req, table, num_external)

    def update_from_connector(self, update: ConnectorUpdate) -> None:
        """Apply the workers' reports: loaded requests join `running` (from prefix +
        loaded tokens); released blocks are freed now that nothing reads or writes them."""
        for rid, num_tokens in update.finished_loads.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue  # finished meanwhile: its blocks are held until released
            prefix, end = self._load_span.pop(rid)
            wanted = end - prefix
            loaded = max(0, min(num_tokens, wanted))
            if loaded < wanted:
                self.counters.loads_short += 1
            req.num_computed_tokens = prefix + loaded
            self.kv.cache_full_blocks(req)
            self._run(req, prefix, loaded)
        for rid in update.released:
            for table in self.held.pop(rid, []):
                self.kv.free_table(table)

    def _release(self, req: Request) -> None:
        """Tell the connector, then free the request's blocks, or keep them while the
        connector uses them."""
        table = list(self.kv.block_table(req.request_id))
        if self.connector.request_finished(req, table) and table:
            self.held.setdefault(req.request_id, []).append(self.kv.detach(req))
        else:
            self.kv.free(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self._release(req)
        lost = max(req.num_computed_tokens, self._lost.get(req.request_id, 0))
        self._lost[req.request_id] = lost
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)
        self._estimate.pop(req.request_id, None)
        out.preempted.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length or aborted) and free its blocks (or hand them
        to `held` while the connector still uses them)."""
        assert status.finished
        if req.request_id in self.loading:
            del self.loading[req.request_id]
            del self._load_span[req.request_id]
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._arrived.pop(req.request_id, None)
        self._estimate.pop(req.request_id, None)
        self._lost.pop(req.request_id, None)
        self._release(req)

    def find(self, request_id: RequestId) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return self.loading.get(request_id)

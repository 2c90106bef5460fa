"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Contract of `schedule()`: every request has num_computed_tokens catching up to num_tokens;
a step gives each chosen request some new tokens to compute, within a token budget of
max_num_batched_tokens. Running requests go first, in admission order (decodes take one
token, unfinished prefills take what the budget leaves); waiting requests are admitted
after, front first, each starting from its longest cached prefix. When blocks run short
the most recently admitted running request is preempted: its blocks are freed, its
progress reset to 0 (recompute; its output tokens are kept), and it goes back to the front
of the waiting queue. Nothing else is mutated; `update` applies a step's results.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from protocol.ids import RequestId


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerCounters:
    """Prompt tokens by source (counted once per request, at first admission) and events."""

    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's work."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adopt a request whose KV is already in place (decode after a handoff)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            prefix = self.kv.find_prefix(req)
            n = min(req.num_tokens - prefix.num_tokens, budget)
            if not self.kv.allocate_slots(req, n, prefix):
                break
            self.waiting.popleft()
            req.num_computed_tokens = prefix.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_cached_prompt_tokens is None:
                cached = min(prefix.num_tokens, req.num_prompt_tokens)
                req.num_cached_prompt_tokens = cached
                self.counters.prompt_tokens_cached += cached
                self.counters.prompt_tokens_computed += req.num_prompt_tokens - cached
            else:
                self.counters.recomputed_tokens += req.num_tokens - prefix.num_tokens
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length or aborted) and free its blocks."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)

    def find(self, request_id: RequestId) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

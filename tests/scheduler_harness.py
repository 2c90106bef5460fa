"""Requests and the model's side of a step for the scheduler's unit tests
(test_scheduler_order.py, test_scheduler_admission.py)."""

from __future__ import annotations

import itertools

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from protocol.hashing import namespace_seed
from protocol.ids import RequestId
from protocol.sampling import SamplingParams

ROOT = namespace_seed("test")
_FIRST_TOKEN = itertools.count(0, 1000)


def unique_request(rid: str, n: int, block_size: int = 4) -> Request:
    """A request of `n` tokens that no other request shares (no prefix hits between them)."""
    first = next(_FIRST_TOKEN)
    return Request(
        RequestId(rid),
        list(range(first, first + n)),
        SamplingParams(),
        block_size=block_size,
        hash_root=ROOT,
    )


def apply_step(sched: Scheduler, out: SchedulerOutput, finish_sampled: bool = True) -> list[str]:
    """What a prefill instance does after the model ran: advance progress; a request that
    sampled its first token leaves (finish_sampled) or decodes on. Returns those sampled."""
    sampled: list[str] = []
    for s in out.scheduled:
        samples = s.samples
        s.request.num_computed_tokens += s.num_new_tokens
        sched.kv.cache_full_blocks(s.request)
        if samples:
            s.request.append_output(7, None)
            sampled.append(s.request.request_id)
            if finish_sampled:
                sched.finish(s.request, RequestStatus.FINISHED_STOPPED)
    return sampled

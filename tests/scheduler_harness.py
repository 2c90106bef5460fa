"""Requests for the scheduler's unit tests (test_scheduler_order.py,
test_scheduler_admission.py)."""

from __future__ import annotations

import itertools

from engine.request import Request
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

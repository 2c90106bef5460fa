"""The worker client's joining of the TokenBatches that one socket read delivers."""

from __future__ import annotations

import random

from protocol.messages import TokenBatch
from router.worker_client import _join, _join_aligning, merge_batches


def test_joining_aligned_batches_matches_the_aligning_join() -> None:
    """`_join`'s loop for the usual batches (aligned logprobs, no alternatives) against
    the general join it falls back to."""
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        batches = [
            TokenBatch("r", list(range(n)), [rng.choice([None, -0.5]) for _ in range(n)], None, n)
            for n in sizes
        ]
        assert _join(batches) == _join_aligning(batches)
    uneven = [TokenBatch("r", [1, 2], [None], None, 2), TokenBatch("r", [3], [0.1], "stop", 3)]
    assert _join(uneven) == _join_aligning(uneven)
    assert _join(uneven).logprobs == [None, None, 0.1]


def test_runs_split_at_a_finish_another_request_or_another_event() -> None:
    def batch(i: int, rid: str = "r", finish: str | None = None) -> TokenBatch:
        return TokenBatch(rid, [i], [None], finish, i)

    merged = merge_batches([batch(1), batch(2, "q"), batch(3, "q", "stop"), batch(4, "q")])
    assert [(b.request_id, b.token_ids) for b in merged] == [("r", [1]), ("q", [2, 3]), ("q", [4])]
    assert merge_batches([batch(1)]) == [batch(1)] and merge_batches([]) == []

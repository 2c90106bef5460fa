"""DecodeAhead: the next pure-decode step, launched before the host has read this step's
tokens, and taken by the next `execute` when the scheduler asks for that step.

The host part of a decode step (the scheduler, input preparation, the graph launch, the
sampled tokens' bookkeeping) leaves the GPU idle in a loop that waits for each step's
tokens before it prepares the next. A decode step's inputs other than its token ids do
not depend on the sampled tokens: positions, KV slots and block tables follow from the
previous step. So, while step N's tokens travel to the host:

    GPU:   forward N | sample N | forward N+1 (ids = sample N's tokens, on the device) | ...
    host:  launch N, sample N, launch N+1 ─┘  wait tokens N, update, schedule N+1 ─┘
           execute(N+1): the scheduled rows match -> N+1's logits, nothing to launch

The launched step is kept if the next schedule is the same requests (or a subset, in the
same order: requests that finished or were aborted drop out) each at the position after
the launched one, with the same KV slot; otherwise it is dropped (its KV writes are the
values a recompute writes for the same token and position, or fall into blocks of
requests that left, which the cache never reads again before they are rewritten: all of
this runs on one stream, in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request import Request
from engine.scheduler import ScheduledRequest
from protocol.ids import BlockId, RequestId


class BlockTables(Protocol):
    def block_table(self, request_id: RequestId) -> list[BlockId]: ...


@dataclass
class DecodeAhead:
    """One launched step: its requests in row order, each one's position and KV slot, and
    its logits [n, V] (a copy: the graph's output buffer is reused)."""

    requests: list[Request]
    positions: list[int]
    slots: list[int]
    logits: torch.Tensor

    def take(
        self, scheduled: Sequence[ScheduledRequest], kv: BlockTables, block_size: int
    ) -> torch.Tensor | None:
        """The logits of `scheduled` if this launched step computed exactly its rows (a
        subsequence of them, each one new token at the launched position and slot, every
        row sampling); None otherwise. O(rows)."""
        reqs, n = self.requests, len(self.requests)
        rows: list[int] = []
        j = 0
        for s in scheduled:
            r = s.request
            if s.num_new_tokens != 1 or not s.samples:
                return None
            while j < n and reqs[j] is not r:
                j += 1
            if j == n:
                return None
            p = self.positions[j]
            if r.num_computed_tokens != p:
                return None
            table = kv.block_table(r.request_id)
            b = p // block_size
            if b >= len(table) or table[b] * block_size + p % block_size != self.slots[j]:
                return None
            rows.append(j)
            j += 1
        if len(rows) == n:
            return self.logits
        if not rows:
            return None
        return self.logits.index_select(0, torch.tensor(rows, device=self.logits.device))

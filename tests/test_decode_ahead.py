"""DecodeAhead.take: a launched decode step is used only for exactly the rows it computed."""

from __future__ import annotations

from typing import Any, cast

import torch

from engine.decode_ahead import DecodeAhead
from engine.scheduler import ScheduledRequest


class _Req:
    def __init__(self, rid: str, computed: int) -> None:
        self.request_id = rid
        self.num_computed_tokens = computed
        self.num_tokens = computed + 1  # one token to compute: it samples


class _KV:
    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    def block_table(self, rid: str) -> list[int]:
        return self.tables[rid]


def _ahead(reqs: list[_Req], kv: _KV) -> DecodeAhead:
    pos = [r.num_computed_tokens for r in reqs]
    slots = [kv.tables[r.request_id][p // 4] * 4 + p % 4 for r, p in zip(reqs, pos, strict=True)]
    logits = torch.arange(len(reqs), dtype=torch.float32)[:, None].expand(-1, 3).clone()
    return DecodeAhead(cast(Any, reqs), pos, slots, logits)


def _sched(reqs: list[_Req], n: int = 1) -> list[ScheduledRequest]:
    return [ScheduledRequest(cast(Any, r), n) for r in reqs]


def test_take_all_subset_and_refusals() -> None:
    a, b, c = _Req("a", 5), _Req("b", 9), _Req("c", 3)
    kv = _KV({"a": [7, 2], "b": [1, 4, 6], "c": [3]})
    ahead = _ahead([a, b, c], kv)
    assert torch.equal(ahead.take(_sched([a, b, c]), kv, 4), ahead.logits)
    sub = ahead.take(_sched([a, c]), kv, 4)  # b finished
    assert sub is not None and sub[:, 0].tolist() == [0.0, 2.0]
    assert ahead.take(_sched([c, a]), kv, 4) is None  # another order
    assert ahead.take(_sched([a, _Req("d", 1)]), kv, 4) is None  # a newcomer
    assert ahead.take(_sched([a, b], 2), kv, 4) is None  # not one token each
    b.num_computed_tokens = 8  # another position (preempted and recomputed)
    assert ahead.take(_sched([a, b]), kv, 4) is None
    b.num_computed_tokens = 9
    kv.tables["b"] = [1, 4, 5]  # another block under the launched slot
    assert ahead.take(_sched([b]), kv, 4) is None
    assert ahead.take(_sched([a]), kv, 4) is not None

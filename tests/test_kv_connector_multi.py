"""MultiConnector over in-memory parts (CPU logic only): metadata and reports split per
part, the first part that matches owns a request's load, a pending lookup holds the parts
after it, and blocks stay held until every holding part released them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.kv_connector_multi import MultiConnectorScheduler, MultiConnectorWorker
from engine.request import Request
from protocol.hashing import namespace_seed
from protocol.ids import BlockId, RequestId
from protocol.sampling import SamplingParams


class Part(KVConnectorScheduler):
    def __init__(self, name: str, match: int | None = 0, hold: bool = False) -> None:
        self.name, self.match, self.hold = name, match, hold
        self.allocs: list[tuple[str, int]] = []
        self.reports: list[list[bytes]] = []
        self.release: set[RequestId] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.match, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.allocs.append((request.request_id, num_external_tokens))

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return self.name.encode() if computed else b""

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        self.reports.append(list(reports))
        out = ConnectorUpdate(released=set(self.release))
        self.release.clear()
        return out

    def request_finished(self, request, block_ids) -> bool:
        return self.hold


class Echo(KVConnectorWorker):
    """Reports what it got as meta, prefixed by its name."""

    def __init__(self, name: str) -> None:
        self.name, self.got = name, b""

    def register_kv_caches(self, kv_caches, place: WorkerPlace) -> None:
        pass

    def start_loads(self, meta: bytes) -> None:
        self.got = meta

    def start_saves(self, meta: bytes) -> None:
        pass

    def get_finished(self) -> bytes:
        return self.name.encode() + b":" + self.got if self.got else b""


def _req(rid: str) -> Request:
    return Request(
        RequestId(rid),
        list(range(40)),
        SamplingParams(max_tokens=1),
        block_size=16,
        hash_root=namespace_seed("t"),
    )


def test_meta_and_reports_split_per_part() -> None:
    a, b = Part("a"), Part("b")
    multi = MultiConnectorScheduler([a, b])
    workers = MultiConnectorWorker([Echo("wa"), Echo("wb")])
    r = _req("r")
    assert multi.build_step_meta([]) == b""  # nothing from any part: no payload at all
    meta = multi.build_step_meta([StepKV(r, 0, 16, [BlockId(0)])])
    workers.start_loads(meta)
    report = workers.get_finished()
    multi.update_from_workers([report, b""])  # two worker processes; the second is silent
    assert a.reports[-1] == [b"wa:a", b""] and b.reports[-1] == [b"wb:b", b""]


def test_first_matching_part_owns_the_load_and_pending_holds_the_rest() -> None:
    a, b = Part("a", match=0), Part("b", match=32)
    multi = MultiConnectorScheduler([a, b])
    r = _req("r")
    assert multi.get_num_new_matched_tokens(r, 0) == (32, True)
    multi.update_state_after_alloc(r, [BlockId(1), BlockId(2)], 32)
    assert a.allocs == [("r", 0)] and b.allocs == [("r", 32)]
    a.match = None  # a lookup in flight in the first part: the answer is not known yet
    assert multi.get_num_new_matched_tokens(_req("s"), 0) == (None, True)


@pytest.mark.parametrize("holders", [(True, False), (True, True)])
def test_blocks_released_when_every_holding_part_released(holders) -> None:
    a, b = Part("a", hold=holders[0]), Part("b", hold=holders[1])
    multi = MultiConnectorScheduler([a, b])
    r = _req("r")
    assert multi.request_finished(r, [BlockId(3)]) is True
    a.release.add(r.request_id)
    first = multi.update_from_workers([b""])
    if holders[1]:
        assert first.released == set()  # b still holds them
        b.release.add(r.request_id)
        assert multi.update_from_workers([b""]).released == {r.request_id}
    else:
        assert first.released == {r.request_id}
    a.hold = b.hold = False
    assert multi.request_finished(_req("x"), [BlockId(4)]) is False  # nobody holds it

"""prefill_worker/handoff.py's scheduler side for requests sent beside decode's
(PrefillRequest.await_landing, protocol 5): nothing leaves before the grant, the first
step after it opens the flow and sends all that is computed, blocks are kept for the
grant and freed when it never comes; the grant's outcomes (accepted, early, conflict,
gone). The end-to-end run over real workers is tests/test_prefill_landing_grant.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec

from engine.kv_connector import StepKV
from engine.request import RequestStatus
from prefill_worker.handoff import GrantOutcome, HandoffScheduler
from protocol.handoff_messages import FlowReport, FlowResult, HandoffMeta
from protocol.ids import BlockId, RequestId
from protocol.kv_layout import KVLayout
from protocol.messages import LandingInfo

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")

LANDING = [
    LandingInfo(
        rank=0,
        transport="tcp",
        peer="127.0.0.1:1",
        buffer_addr=4096,
        capacity_bytes=1 << 20,
        layout=LAYOUT,
    )
]


def _req(rid: str, status: RequestStatus = RequestStatus.RUNNING) -> Any:
    return SimpleNamespace(request_id=rid, status=status)


def _step(h: HandoffScheduler, *kv: tuple[Any, int, int, list[int]]) -> HandoffMeta | None:
    meta = h.build_step_meta(
        [StepKV(r, start, end, [BlockId(b) for b in blocks]) for r, start, end, blocks in kv]
    )
    return msgspec.msgpack.decode(meta, type=HandoffMeta) if meta else None


def _closed(h: HandoffScheduler, rid: str, stages: int = 1) -> set[RequestId]:
    report = msgspec.msgpack.encode(FlowReport([FlowResult(rid, None, 64, 1, 0.01)]))
    return h.update_from_workers([report] * stages).released


def test_nothing_leaves_before_the_grant_then_all_that_is_computed() -> None:
    h = HandoffScheduler(2)
    r = _req("a")
    assert h.await_landing("a", 40) is None
    assert _step(h, (r, 0, 16, [7])) is None  # computed, no landing yet: nothing sent
    assert _step(h, (r, 16, 32, [7, 8])) is None
    assert not h.has_pending()  # waiting for a grant costs no polls
    assert h.grant("a", LANDING, "http://d/kv_notify") is GrantOutcome.ACCEPTED
    assert h.has_pending()
    meta = _step(h, (r, 32, 40, [7, 8, 9]))  # the grant's step: the backlog, then this step
    assert meta is not None
    assert [(o.request_id, o.num_prompt_tokens, o.notify_url) for o in meta.opens] == [
        ("a", 40, "http://d/kv_notify")
    ]
    assert [(s.token_start, s.token_end, s.block_table, s.last) for s in meta.sends] == [
        (0, 32, [7, 8], False),
        (32, 40, [7, 8, 9], True),
    ]
    assert h.request_finished(r, [BlockId(7), BlockId(8), BlockId(9)])  # flows still open
    assert _closed(h, "a", stages=2) == {"a"}  # both stages closed: blocks released
    assert h.grant("a", LANDING, "u") is GrantOutcome.GONE


def test_a_request_done_before_its_grant_keeps_its_blocks_and_sends_once_granted() -> None:
    h = HandoffScheduler(1)
    r = _req("b")
    h.await_landing("b", 20)
    _step(h, (r, 0, 20, [3, 4]))
    r.status = RequestStatus.FINISHED_LENGTH
    assert h.request_finished(r, [BlockId(3), BlockId(4)])  # kept for the grant
    assert not h.has_pending()  # parked: no engine steps
    assert h.grant("b", LANDING, "u") is GrantOutcome.ACCEPTED
    assert h.grant("b", LANDING, "u") is GrantOutcome.CONFLICT
    meta = _step(h)  # a poll step: nothing scheduled
    assert meta is not None and [(s.token_start, s.token_end, s.last) for s in meta.sends] == [
        (0, 20, True)
    ]
    assert _closed(h, "b") == {"b"}


def test_no_grant_frees_the_kept_blocks_and_a_late_one_is_gone() -> None:
    h = HandoffScheduler(1)
    r = _req("c")
    h.await_landing("c", 20)
    _step(h, (r, 0, 20, [5, 6]))
    r.status = RequestStatus.FINISHED_LENGTH
    assert h.request_finished(r, [BlockId(5), BlockId(6)])
    assert h.awaiting("c")
    h.cancel("c")  # landing_wait_s passed (or an abort, or a finish at the first token)
    assert not h.awaiting("c") and h.has_pending()
    assert h.update_from_workers([b""]).released == {"c"}  # freed without any flow
    assert h.grant("c", LANDING, "u") is GrantOutcome.GONE
    assert _step(h) is None


def test_an_early_grant_is_applied_when_its_request_comes() -> None:
    h = HandoffScheduler(1)
    assert h.grant("d", LANDING, "http://d/n") is GrantOutcome.EARLY
    assert h.await_landing("d", 16) == "http://d/n"
    meta = _step(h, (_req("d"), 0, 16, [1]))
    assert meta is not None and meta.opens[0].num_prompt_tokens == 16
    assert [(s.token_start, s.token_end, s.last) for s in meta.sends] == [(0, 16, True)]
    # an early grant expires: a request registered after its TTL waits for a new one
    h = HandoffScheduler(1, early_ttl_s=0.0)
    assert h.grant("e", LANDING, "u") is GrantOutcome.EARLY
    assert h.await_landing("e", 16) is None and h.awaiting("e")


def test_aborts_and_preemptions_while_awaiting() -> None:
    h = HandoffScheduler(1)
    r = _req("f")
    h.await_landing("f", 64)
    _step(h, (r, 0, 32, [1, 2]))
    r.status = RequestStatus.WAITING  # preempted before any send: its blocks go
    assert not h.request_finished(r, [BlockId(1), BlockId(2)])
    h.grant("f", LANDING, "u")
    assert not h.has_pending()  # nothing computed any more: nothing to flush
    r.status = RequestStatus.RUNNING
    meta = _step(h, (r, 0, 48, [4, 5, 6]))  # recomputed (prefix hits are sent too)
    assert meta is not None and [(s.token_start, s.token_end) for s in meta.sends] == [(0, 48)]
    g = _req("g")
    h.await_landing("g", 32)
    _step(h, (g, 0, 16, [9]))
    g.status = RequestStatus.FINISHED_ABORTED
    assert not h.request_finished(g, [BlockId(9)])  # aborted before its grant: freed now
    assert h.grant("g", LANDING, "u") is GrantOutcome.GONE
    # an inline request (landing in the PrefillRequest) has its landing: a grant conflicts
    h.add("i", LANDING, 16, "u")
    assert h.grant("i", LANDING, "u") is GrantOutcome.CONFLICT

"""Decode's handoff receiver (the connector's scheduler side) in isolation: what it claims,
when a request may run, how a failed flow ends the load short, and the landing fence
(a region is reused only when no write into it can still be in flight)."""

from __future__ import annotations

import msgspec

from decode_worker.receiver import HandoffReceiver
from engine.request import Request, RequestStatus
from protocol.handoff_messages import ScatterMeta, ScatterReport
from protocol.hashing import namespace_seed
from protocol.ids import BlockId, RequestId
from protocol.kv_layout import KVLayout
from protocol.messages import FlowClosed, KVSegment, SegmentsLanded
from protocol.sampling import SamplingParams
from transfer import LandingArena

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
N = 40  # prompt tokens


def _setup(rid: str = "r") -> tuple[HandoffReceiver, LandingArena, Request, list[str]]:
    arena = LandingArena(1 << 20)
    receiver = HandoffReceiver(arena, 1, LAYOUT)
    region = arena.allocate(rid, N * LAYOUT.bytes_per_token, 0)
    assert region is not None
    events: list[str] = []
    receiver.expect(rid, region, N, lambda: events.append("ready"))
    req = Request(
        RequestId(rid),
        list(range(100, 100 + N)),
        SamplingParams(max_tokens=8),
        block_size=16,
        hash_root=namespace_seed("test"),
    )
    return receiver, arena, req, events


def _seg(a: int, b: int) -> KVSegment:
    return KVSegment(a, b, 0, (b - a) * LAYOUT.bytes_per_token, 0, 0, 2)


def _scatter_step(receiver: HandoffReceiver) -> dict[RequestId, int]:
    """One engine step: the meta's pieces all scattered by the (one) rank."""
    meta = receiver.build_step_meta([])
    done = (
        [p.piece_id for p in msgspec.msgpack.decode(meta, type=ScatterMeta).scatters]
        if meta
        else []
    )
    report = msgspec.msgpack.encode(ScatterReport(done))
    return receiver.update_from_workers([report]).finished_loads


def test_claims_the_prompt_past_its_prefix_and_runs_after_every_piece_and_first_token():
    receiver, arena, req, events = _setup()
    assert receiver.get_num_new_matched_tokens(req, 16) == (N - 16, True)
    req.num_computed_tokens = 16
    receiver.update_state_after_alloc(req, [BlockId(b) for b in (7, 8, 9)], N - 16)
    assert events == ["ready"] and receiver.has_pending()
    first = receiver.landed(SegmentsLanded("r", 0, 1, [_seg(0, 24)]))
    assert not first.done()  # answered only once scattered
    meta = msgspec.msgpack.decode(receiver.build_step_meta([]), type=ScatterMeta)
    assert meta.scatters[0].skip_below == 16 and meta.scatters[0].block_table == [7, 8, 9]
    receiver.update_from_workers(
        [msgspec.msgpack.encode(ScatterReport([meta.scatters[0].piece_id]))]
    )
    assert first.result(0) is True
    second = receiver.landed(SegmentsLanded("r", 0, 1, [_seg(24, N)]))
    assert _scatter_step(receiver) == {} and second.result(0)  # landed, no first token yet
    assert arena.used_bytes == 0  # every byte scattered: the region is free already
    assert receiver.first_token("r")
    assert _scatter_step(receiver) == {RequestId("r"): N - 16}
    assert not receiver.has_pending() and not receiver.holds("r")


def test_out_of_order_segments_are_refused():
    receiver, _, req, _ = _setup()
    receiver.get_num_new_matched_tokens(req, 0)
    receiver.update_state_after_alloc(req, [BlockId(1), BlockId(2), BlockId(3)], N)
    assert receiver.landed(SegmentsLanded("r", 0, 1, [_seg(8, 16)])).result(0) is False


def test_a_failed_flow_ends_the_load_short_at_a_block_boundary():
    receiver, _, req, _ = _setup()
    receiver.get_num_new_matched_tokens(req, 0)
    receiver.update_state_after_alloc(req, [BlockId(1), BlockId(2), BlockId(3)], N)
    receiver.landed(SegmentsLanded("r", 0, 1, [_seg(0, 20)]))
    _scatter_step(receiver)
    receiver.closed(FlowClosed("r", 0, 1, "injected fault"))
    receiver.first_token("r")
    assert _scatter_step(receiver) == {RequestId("r"): 16}  # recompute from token 16


def test_landing_fence():
    # aborted while prefill may still write: held until every stage closed its flow
    receiver, arena, req, _ = _setup()
    receiver.get_num_new_matched_tokens(req, 0)
    receiver.update_state_after_alloc(req, [BlockId(1), BlockId(2), BlockId(3)], N)
    queued = receiver.landed(SegmentsLanded("r", 0, 2, [_seg(0, 8)]))
    req.status = RequestStatus.FINISHED_ABORTED
    assert receiver.request_finished(req, []) is False  # the pages are free at once
    receiver.abort("r", prefill_contacted=True)
    assert queued.result(0) is False  # prefill stops sending
    assert arena.used_bytes > 0
    receiver.closed(FlowClosed("r", 0, 2, "aborted"))
    assert arena.used_bytes > 0  # stage 1 may still be writing
    receiver.closed(FlowClosed("r", 1, 2, "aborted"))
    assert arena.used_bytes == 0 and not receiver.holds("r")

    # no prefill was ever contacted: nothing can be in flight
    receiver, arena, req, _ = _setup("q")
    receiver.abort("q", prefill_contacted=False)
    assert arena.used_bytes == 0

    # a prefill that died mid-write never closes: freed after the quarantine
    receiver, arena, req, _ = _setup("z")
    receiver.abort("z", prefill_contacted=True)
    assert receiver.reap(quarantine_s=60) == [] and arena.used_bytes > 0
    assert receiver.reap(quarantine_s=0) == ["z"] and arena.used_bytes == 0

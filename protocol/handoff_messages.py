"""The P->D handoff connector's messages between the processes of ONE instance (msgpack
inside the engine's step messages, protocol/rank_messages.py; never pickle).

    prefill  stage 0 (scheduler side) ── HandoffMeta ──▶ every stage's HandoffSender
             every stage ── FlowReport ──▶ stage 0     (flows closed: blocks released)
    decode   rank 0 (scheduler side) ── ScatterMeta ──▶ every rank: landed pieces into
                                                        its pages, before the forward
             every rank ── ScatterReport ──▶ rank 0    (pieces scattered: ring space free)
"""

from __future__ import annotations

import msgspec

from protocol.messages import KVSegment, LandingInfo


class FlowOpen(msgspec.Struct, frozen=True, array_like=True):
    """Start sending a request: where to (one landing per decode rank), where to notify."""

    request_id: str
    num_prompt_tokens: int
    landing: list[LandingInfo]
    notify_url: str


class FlowSend(msgspec.Struct, frozen=True, array_like=True):
    """KV of tokens [token_start, token_end) is computed in `block_table`: send it.
    `last`: the prompt's end (nothing more follows)."""

    request_id: str
    token_start: int
    token_end: int
    block_table: list[int]
    last: bool


class HandoffMeta(msgspec.Struct, frozen=True, array_like=True):
    opens: list[FlowOpen] = []
    sends: list[FlowSend] = []
    cancels: list[str] = []


def without_sends(meta: HandoffMeta, request_ids: set[str]) -> HandoffMeta:
    """`meta` without the sends of `request_ids` (their forward failed: their KV of the
    step is not valid). Opens and cancels stay: the flows close through the cancel that
    follows the requests' failure."""
    sends = [s for s in meta.sends if s.request_id not in request_ids]
    return HandoffMeta(meta.opens, sends, meta.cancels)


class FlowResult(msgspec.Struct, frozen=True, array_like=True):
    """A stage's flow of a request closed: nothing of it reads blocks or writes anymore."""

    request_id: str
    error: str | None
    num_bytes: int
    num_ops: int
    seconds: float


class FlowReport(msgspec.Struct, frozen=True, array_like=True):
    closed: list[FlowResult] = []


class PieceScatter(msgspec.Struct, frozen=True, array_like=True):
    """Decode: scatter one landed piece (every rank takes its own segments) from the
    request's landing region (bytes [offset_bytes, + nbytes) of each rank's buffer)
    into its pages; tokens below skip_below are decode's own prefix cache."""

    piece_id: int
    request_id: str
    offset_bytes: int
    nbytes: int
    block_table: list[int]
    segments: list[KVSegment]
    skip_below: int


class ScatterMeta(msgspec.Struct, frozen=True, array_like=True):
    scatters: list[PieceScatter] = []


class ScatterReport(msgspec.Struct, frozen=True, array_like=True):
    done: list[int] = []
    failed: list[tuple[int, str]] = []

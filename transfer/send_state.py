"""What the handoff sender keeps per request (transfer/sender.py): a flow to every decode
rank, its pieces in flight, its writes. Guarded by the sender's lock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.messages import KVSegment, LandingInfo
from transfer.ring import RingSpace


@dataclass(frozen=True)
class SendResult:
    """A request's flow from this stage closed (its blocks are no longer read)."""

    request_id: str
    error: str | None
    num_bytes: int
    num_ops: int
    seconds: float


@dataclass
class Piece:
    token_start: int
    token_end: int
    segments: list[KVSegment] = field(default_factory=list)
    writes_left: int = 0


@dataclass
class Flow:
    """One request's flow from this stage to every decode rank."""

    request_id: str
    landing: list[LandingInfo]
    num_prompt_tokens: int
    notify_url: str
    rings: list[RingSpace]
    ring_start: int
    pending: deque[tuple[int, int, list[int], object]] = field(default_factory=deque)
    """Submitted (token_start, token_end, block_table, ready event) not yet packed."""
    last_submitted: bool = False
    unacked: int = 0
    """Pieces written (or being written) whose SegmentsLanded decode has not answered."""
    writes_in_flight: int = 0
    packing: bool = False
    error: str | None = None
    cancelled: bool = False
    closed: bool = False
    num_bytes: int = 0
    num_ops: int = 0
    seconds: float = 0.0


@dataclass
class Write:
    flow: Flow
    piece: Piece
    slot: int
    peer: str
    peer_incarnation: str
    remote_addr: int
    nbytes: int

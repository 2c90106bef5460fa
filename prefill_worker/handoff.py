"""Per-request handoff state on the prefill side, driven from the engine thread.

The engine's KV observer fires after every step that computed tokens of a request; the
request's KV [sent_upto, end) is then gathered and written into decode's landing region
right behind the previous segment:

    landing region:  | seg 0: tokens [0, c0) | seg 1: [c0, c1) | ... |
                     ^ offset 0               ^ bytes(seg 0)

Tokens served from the prefix cache were never computed in a step, so the first segment
starts at token 0, not at the first computed token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.request import Request
from protocol.ids import BlockId
from protocol.messages import HandoffDone, KVSegment, LandingInfo
from transfer import HandoffSender, TransferError
from transfer.errors import PackLayoutError

log = logging.getLogger(__name__)


@dataclass
class Handoff:
    """What has been sent of one request, and whether sending failed."""

    landing: LandingInfo
    sent_upto: int = 0
    offset_bytes: int = 0
    segments: list[KVSegment] = field(default_factory=list)
    num_bytes: int = 0
    num_ops: int = 0
    seconds: float = 0.0
    error: str | None = None

    def done_event(self, request_id: str) -> HandoffDone:
        return HandoffDone(
            request_id=request_id,
            segments=self.segments,
            num_bytes=self.num_bytes,
            num_ops=self.num_ops,
            seconds=self.seconds,
        )


class HandoffTable:
    """Owns the live handoffs of one prefill instance. Engine thread only."""

    def __init__(self, sender: HandoffSender, kv_caches: list[torch.Tensor]) -> None:
        self.sender = sender
        self.kv_caches = kv_caches
        self._live: dict[str, Handoff] = {}

    def add(self, request_id: str, landing: LandingInfo) -> None:
        self._live[request_id] = Handoff(landing)

    def pop(self, request_id: str) -> Handoff | None:
        return self._live.pop(request_id, None)

    def observe(self, req: Request, start: int, end: int, table: list[BlockId]) -> None:
        """The engine's KV observer: send KV [sent_upto, end) of the request's prompt."""
        h = self._live.get(req.request_id)
        if h is None or h.error is not None:
            return
        end = min(end, req.num_prompt_tokens)
        if end <= h.sent_upto:
            return
        try:
            seg, stats = self.sender.send(
                self.kv_caches, list(table), h.sent_upto, end, h.landing, h.offset_bytes
            )
        except (TransferError, PackLayoutError) as e:
            log.warning("handoff of %s failed: %s", req.request_id, e)
            h.error = f"KV handoff to decode failed: {e}"
            return
        h.segments.append(seg)
        h.sent_upto = end
        h.offset_bytes += seg.num_bytes
        h.num_bytes += stats.num_bytes
        h.num_ops += stats.num_ops
        h.seconds += stats.seconds

"""The landing ring of one request: how the flows share a decode rank's landing region.

A request's landing region (one per decode rank, the same size and offset on every rank)
is cut between the prefill stages by layers; each stage streams its pieces through its
part as a ring, in order, and reuses bytes only after decode acknowledged the piece that
held them (decode scattered it into the request's pages):

    region of rank r, capacity C, a prefill of L layers in stages [l0_s, l1_s)
    | stage 0: [C*l0_0/L, C*l1_0/L)          | stage 1: [C*l0_1/L, C*l1_1/L)   | ...
    |  piece k | piece k+1 |....free....|    |  ...                            |
               ^ oldest unacknowledged piece: freed first (FIFO)

A piece never wraps: when it does not fit before the end, it starts again at 0 (the tail
is skipped until the ring drains past it). So a region smaller than the prompt's KV is
flow control, never a refusal; a region that holds the whole prompt never waits.
"""

from __future__ import annotations

from collections import deque

from protocol.kv_layout import KVLayout
from protocol.parallel import stripe_len

RING_ALIGN = 256
"""Stage rings and pieces start on this many bytes (any dtype view is aligned)."""


def stage_ring(capacity_bytes: int, layers: tuple[int, int], num_layers: int) -> tuple[int, int]:
    """(start, size) in bytes of the stage holding `layers` inside a region of
    `capacity_bytes`: its share of the region in proportion to its layers."""
    l0, l1 = layers
    start = capacity_bytes * l0 // num_layers // RING_ALIGN * RING_ALIGN
    end = capacity_bytes * l1 // num_layers // RING_ALIGN * RING_ALIGN
    return start, end - start


def piece_bytes(layout: KVLayout, num_stage_layers: int, num_rank_tokens: int) -> int:
    """Bytes of a piece: the rank's tokens x the stage's layers, packed."""
    return num_rank_tokens * num_stage_layers * layout.bytes_per_token_per_layer


def rank_tokens(token_start: int, token_end: int, dcp_size: int, dcp_rank: int) -> int:
    """Tokens of [token_start, token_end) a rank of the DCP stripe holds."""
    return stripe_len(token_start, token_end, dcp_size, dcp_rank)


class RingSpace:
    """Owns the free space of one byte ring of `size` bytes: `place` reserves the next
    `nbytes` (contiguous, FIFO), `release_oldest` frees the oldest reservation. Not
    thread-safe: the caller's lock guards it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._head = 0
        """Where the next piece starts (unless it must wrap to 0)."""
        self._live: deque[tuple[int, int]] = deque()
        """(offset, end) of reserved pieces, oldest first; end includes a skipped tail."""

    @property
    def empty(self) -> bool:
        return not self._live

    def place(self, nbytes: int) -> int | None:
        """The offset of a new piece of `nbytes`, or None while it does not fit yet."""
        need = -(-nbytes // RING_ALIGN) * RING_ALIGN
        if need > self.size:
            return None
        if not self._live:
            offset = 0
        else:
            tail, head = self._live[0][0], self._head
            if head > tail:  # used [tail, head): free [head, size) then [0, tail)
                if head + need <= self.size:
                    offset = head
                elif need <= tail:
                    offset = 0
                else:
                    return None
            elif head + need <= tail:  # wrapped, used [tail, size) + [0, head)
                offset = head
            else:
                return None
        self._live.append((offset, offset + need))
        self._head = offset + need
        return offset

    def release_oldest(self) -> None:
        """Decode acknowledged the oldest piece: its bytes may be written again."""
        self._live.popleft()

    def release_newest(self) -> None:
        """Undo the last `place` (a piece that did not fit on every rank)."""
        self._live.pop()
        self._head = self._live[-1][1] if self._live else 0

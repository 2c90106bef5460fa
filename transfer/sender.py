"""Prefill side of the handoff: gather a token range into staging, write it to the landing.

A segment of n tokens is packed [L, 2, n, h, D] = 2L rows of n tokens (kv_pack). When the
staging buffer is smaller than the segment, it is sent in pieces that are contiguous in
the packed format, so the landing still holds one [L, 2, n, h, D] segment:

    staging holds >= 1 row:  pieces of whole rows        |r0 r1 r2|r3 r4 r5|...|r2L-1|
    staging holds < 1 row:   token sub-ranges of a row   |r0[0:k]|r0[k:2k]|...|r1[0:k]|...

    piece (rows [r, r'), tokens [a, b)) lands at
        landing.buffer_addr + offset_bytes + r * n * tok_bytes + a * tok_bytes

Every piece is one `Transport.write`, i.e. ops of at most 8 MiB; a segment that fits the
staging buffer costs exactly ceil(bytes / 8 MiB) ops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from protocol.messages import KVSegment, LandingInfo
from transfer.errors import PackLayoutError
from transfer.kv_pack import (
    KVShard,
    cache_geometry,
    gather_rows,
    packed_view,
    slots_for,
    torch_dtype,
)
from transfer.transport import Transport, WriteStats


def _pieces(
    num_rows: int, n: int, tok_bytes: int, staging_bytes: int
) -> Iterator[tuple[int, int, int, int]]:
    """(row_start, row_end, token_start, token_end) of each piece, in landing order."""
    row_bytes = n * tok_bytes
    if row_bytes <= staging_bytes:
        step = staging_bytes // row_bytes
        for r in range(0, num_rows, step):
            yield r, min(r + step, num_rows), 0, n
        return
    step = staging_bytes // tok_bytes
    if step == 0:
        raise PackLayoutError(
            f"staging of {staging_bytes} bytes cannot hold one token of one layer ({tok_bytes} bytes)"
        )
    for r in range(num_rows):
        for a in range(0, n, step):
            yield r, r + 1, a, min(a + step, n)


class HandoffSender:
    """Owns a staging buffer registered with `transport` (on `device`, which must be the
    KV cache's device) and sends packed KV segments into decode landing regions.
    One send at a time (a lock serializes callers): the staging buffer is shared."""

    def __init__(
        self, transport: Transport, staging_bytes: int, device: torch.device | str = "cpu"
    ) -> None:
        if staging_bytes <= 0:
            raise PackLayoutError(f"staging size {staging_bytes} must be positive")
        pin = torch.device(device).type == "cpu" and torch.cuda.is_available()
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.transport = transport
        transport.register_buffer(self.staging.data_ptr(), staging_bytes)
        self._lock = threading.Lock()

    def send(
        self,
        kv_caches: list[torch.Tensor],
        block_table: list[int],
        token_start: int,
        token_end: int,
        landing: LandingInfo,
        offset_bytes: int,
        shard: KVShard | None = None,
        layers: tuple[int, int] | None = None,
    ) -> tuple[KVSegment, WriteStats]:
        """Pack tokens [token_start, token_end) (the shard's heads and stripe; default:
        what the landing's rank holds, transfer.flows.shard_of) and write them at landing
        offset `offset_bytes`. `layers`: the model layers [start, end) that kv_caches
        hold (a pipeline stage's); None: kv_caches are all of the landing's layers.
        Returns the segment to report to decode and what moved (seconds = wall time of
        gather + writes). Streaming: call once per prefill chunk.
        Raises PackLayoutError (mismatch, overflow) or TransferError (write failed)."""
        with self._lock:
            start = time.perf_counter()
            _, block_size, num_heads, head_dim = cache_geometry(kv_caches)
            dtype = kv_caches[0].dtype
            layout = landing.layout
            if shard is None:
                shard = KVShard(
                    landing.kv_head_start,
                    landing.kv_head_start + layout.num_kv_heads,
                    landing.dcp_size,
                    landing.dcp_rank,
                )
            l0, l1 = layers if layers is not None else (0, layout.num_layers)
            h0, h1 = shard.heads(num_heads)
            if (
                len(kv_caches) != l1 - l0
                or not 0 <= l0 < l1 <= layout.num_layers
                or h1 - h0 != layout.num_kv_heads
                or head_dim != layout.head_dim
                or dtype != torch_dtype(layout)
            ):
                raise PackLayoutError(
                    f"landing layout {layout} does not match the cache: {len(kv_caches)} "
                    f"layers as [{l0}, {l1}), heads [{h0}, {h1}), head_dim {head_dim}, {dtype}"
                )
            if landing.transport != self.transport.name:
                raise PackLayoutError(
                    f"landing wants transport {landing.transport!r}, this sender has "
                    f"{self.transport.name!r}"
                )
            n = shard.num_tokens(token_start, token_end)
            num_bytes = n * (l1 - l0) * layout.bytes_per_token_per_layer
            if offset_bytes < 0 or offset_bytes + num_bytes > landing.capacity_bytes:
                raise PackLayoutError(
                    f"segment [{offset_bytes}, +{num_bytes}) exceeds the landing region of "
                    f"{landing.capacity_bytes} bytes"
                )
            segment = KVSegment(
                token_start, token_end, offset_bytes, num_bytes, landing.rank, l0, l1
            )
            if n == 0:
                return segment, WriteStats()
            slots = slots_for(
                block_table,
                block_size,
                shard.tokens(token_start, token_end),
                self.staging.device,
            )
            tok_bytes = layout.bytes_per_token_per_layer // 2
            stats = WriteStats()
            pieces = _pieces(2 * len(kv_caches), n, tok_bytes, self.staging.numel())
            for r0, r1, a, b in pieces:
                out = packed_view(self.staging, 0, (r1 - r0, b - a, h1 - h0, head_dim), dtype)
                gather_rows(kv_caches, slots[a:b], (h0, h1), r0, out)
                remote = landing.buffer_addr + offset_bytes + (r0 * n + a) * tok_bytes
                nbytes = (r1 - r0) * (b - a) * tok_bytes
                stats += self.transport.write(landing.peer, self.staging.data_ptr(), remote, nbytes)
            seconds = time.perf_counter() - start
            return segment, WriteStats(stats.num_bytes, stats.num_ops, seconds)

    def close(self) -> None:
        self.transport.unregister_buffer(self.staging.data_ptr())

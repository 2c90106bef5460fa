"""Decode side of the handoff: a registered landing arena carved into per-request regions.

    arena (one registered host buffer, total_bytes)
    |-- req A --|.....free.....|------ req B ------|--free--|
    ^ base      ^ free list entries (offset, size), sorted by offset, neighbours merged

Prefill streams a request's KV segments through its region (a ring, transfer/ring.py;
LandingInfo tells it where); decode scatters each landed piece into the request's pages
and frees the region once no write into it can be in flight. When the arena is full,
`allocate` waits (first come, first served) until frees make room or its timeout ends:
running out of landing space is back-pressure, not an error. A region is at most
`max_region_bytes` (a share of the arena, protocol/parallel.py) whatever the prompt: a long prompt streams
through it, so no request is refused for its size.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from protocol.kv_layout import KVLayout
from protocol.messages import KVSegment, LandingInfo
from protocol.parallel import landing_region_max
from transfer.errors import LandingError
from transfer.kv_pack import FULL, KVShard, packed_view, scatter, torch_dtype
from transfer.transport import Transport

ALIGN_BYTES = 4096
"""Region starts and sizes are multiples of this: any dtype view is aligned, and RDMA
page boundaries are not shared between requests."""


@dataclass(frozen=True)
class LandingRegion:
    """Bytes [offset_bytes, offset_bytes + nbytes) of the arena, held by one request."""

    request_id: str
    offset_bytes: int
    nbytes: int
    addr: int
    """Absolute address of the region's first byte (what LandingInfo.buffer_addr says)."""
    buffer: torch.Tensor
    """uint8 view of the region's bytes."""


class LandingArena:
    """Owns one buffer (pinned host memory, or device memory on `device` for GPU to GPU
    transports such as cuda_ipc), registered with `transport`,
    and the first-fit free list that hands its bytes out as per-request regions.
    All methods are thread-safe."""

    def __init__(
        self,
        total_bytes: int,
        transport: Transport | None = None,
        max_region_bytes: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if total_bytes <= 0 or total_bytes % ALIGN_BYTES:
            raise LandingError(f"landing size {total_bytes} must be a positive multiple of 4 KiB")
        cap = max_region_bytes or landing_region_max(total_bytes)
        self.max_region_bytes = max(ALIGN_BYTES, min(cap, total_bytes) // ALIGN_BYTES * ALIGN_BYTES)
        """The largest region handed out: a prompt whose KV is larger streams through it."""
        on_gpu = torch.device(device).type == "cuda"
        self.buffer = torch.empty(
            total_bytes,
            dtype=torch.uint8,
            device=device,
            pin_memory=not on_gpu and torch.cuda.is_available(),
        )
        self.base_addr = self.buffer.data_ptr()
        self.transport = transport
        if transport is not None:
            transport.register_tensor(self.buffer)
        self._total = total_bytes
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, total_bytes)]  # (offset, size) by offset
        self._regions: dict[str, LandingRegion] = {}
        self._used = 0
        self._queue: deque[int] = deque()  # tickets of waiting allocate calls, FIFO
        self._tickets = itertools.count()
        self._closed = False

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    def region(self, request_id: str) -> LandingRegion | None:
        with self._cond:
            return self._regions.get(request_id)

    def allocate(self, request_id: str, nbytes: int, timeout_s: float) -> LandingRegion | None:
        """A region of min(nbytes, max_region_bytes) for `request_id`, waiting up to
        timeout_s for room (behind earlier waiters). None when the time ran out or the
        arena closed."""
        size = min(-(-max(nbytes, 1) // ALIGN_BYTES) * ALIGN_BYTES, self.max_region_bytes)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if request_id in self._regions:
                raise LandingError(f"request {request_id} already holds a landing region")
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                while True:
                    if self._closed:
                        return None
                    offset = self._take(size) if self._queue[0] == ticket else None
                    if offset is not None:
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            region = LandingRegion(
                request_id,
                offset,
                size,
                self.base_addr + offset,
                self.buffer[offset : offset + size],
            )
            self._regions[request_id] = region
            self._used += size
            return region

    def mirror(self, request_id: str, offset_bytes: int, nbytes: int) -> LandingRegion:
        """The bytes [offset_bytes, + nbytes) of this arena as a region, where another
        rank's arena of the same size allocated them (decode TP: rank 0 allocates one
        offset for every rank). No bookkeeping here; the allocating arena owns it."""
        if offset_bytes < 0 or offset_bytes + nbytes > self._total:
            raise LandingError(
                f"region [{offset_bytes}, +{nbytes}) of {request_id} is outside this "
                f"{self._total}-byte arena: the ranks' landing sizes differ"
            )
        view = self.buffer[offset_bytes : offset_bytes + nbytes]
        return LandingRegion(request_id, offset_bytes, nbytes, self.base_addr + offset_bytes, view)

    def free(self, request_id: str) -> bool:
        """Give the request's region back (on completion and on abort). False if it holds
        none (already freed, or never got one): aborts may race completion."""
        with self._cond:
            region = self._regions.pop(request_id, None)
            if region is None:
                return False
            self._used -= region.nbytes
            self._give(region.offset_bytes, region.nbytes)
            self._cond.notify_all()
            return True

    def landing_info(self, region: LandingRegion, rank: int, layout: KVLayout) -> LandingInfo:
        """What prefill needs to write into `region` (sent to it in DecodeReady)."""
        if self.transport is None:
            raise LandingError("this arena has no transport: pass one to LandingArena")
        return LandingInfo(
            rank=rank,
            transport=self.transport.name,
            peer=self.transport.peer_address,
            peer_incarnation=self.transport.incarnation,
            buffer_addr=region.addr,
            capacity_bytes=region.nbytes,
            layout=layout,
        )

    def close(self) -> None:
        """Wake waiters (they get None) and unregister the buffer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.transport is not None:
            self.transport.unregister_buffer(self.base_addr)
            self.transport = None

    def _take(self, size: int) -> int | None:
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                return off
        return None

    def _give(self, offset: int, size: int) -> None:
        """Insert [offset, +size) into the free list, merging with touching neighbours."""
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, prev = self._free[i - 1]
            size += prev
            self._free[i - 1] = (offset, size)
        else:
            self._free.insert(i, (offset, size))

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, by offset (for tests and status)."""
        with self._cond:
            return list(self._free)


def scatter_segments(
    region: LandingRegion,
    segments: list[KVSegment],
    layout: KVLayout,
    kv_caches: list[torch.Tensor],
    block_table: list[int],
    shard: KVShard = FULL,
    skip_below: int = 0,
) -> None:
    """Unpack every landed segment of `region` into the paged cache (kv_pack.scatter):
    segment layers [layer_start, layer_end) go to kv_caches[layer_start:layer_end], its
    tokens are the shard's stripe (kv_caches hold the shard's heads, all layers). Tokens
    below `skip_below` are not written (decode's own prefix cache holds them, in blocks
    other requests may be reading). Each segment must be exactly its tokens x layers of
    `layout`, inside the region."""
    dtype = torch_dtype(layout)
    for seg in segments:
        n = shard.num_tokens(seg.token_start, seg.token_end)
        l0 = seg.layer_start
        l1 = layout.num_layers if seg.layer_end is None else seg.layer_end
        if not 0 <= l0 < l1 <= min(layout.num_layers, len(kv_caches)):
            raise LandingError(f"segment {seg} has layers outside [0, {layout.num_layers})")
        want = n * (l1 - l0) * layout.bytes_per_token_per_layer
        if seg.num_bytes != want:
            raise LandingError(
                f"segment {seg} carries {seg.num_bytes} bytes; {n} tokens x {l1 - l0} "
                f"layers of the layout need {want}"
            )
        if seg.offset_bytes + seg.num_bytes > region.nbytes:
            raise LandingError(f"segment {seg} ends past region of {region.nbytes} bytes")
        start = max(seg.token_start, skip_below)
        if start >= seg.token_end or n == 0:
            continue
        shape = (l1 - l0, layout.num_parts, n, layout.num_kv_heads, layout.row_width)
        src = packed_view(region.buffer, seg.offset_bytes, shape, dtype)
        skipped = shard.num_tokens(seg.token_start, start)
        if skipped:
            src = src[:, :, skipped:]
        # host landing -> pages: a blocking copy (the ring bytes are reused next); a landing
        # on the pages' GPU is read in place (LandingWorker waits for the scatter's event)
        src = src.to(kv_caches[0].device)
        scatter(src, kv_caches[l0:l1], block_table, start, seg.token_end, shard)

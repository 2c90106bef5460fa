"""GpuRestore: the pool worker's verified restore of loaded objects into a CUDA KV cache.

The objects of one window are in the client's pinned load slots (client.read); they go
to the device in groups of VERIFY_GROUP over two staging buffers, are checksummed there,
compared with their headers on the host, and unpacked into the pages:

    copy stream:    H2D g0 | H2D g1 | H2D g2 (waits: unpack g0 freed buffer 0) | ...
    unpack stream:           sums g0 | unpack g0 | sums g1 | unpack g1 | ...
    load thread:    queue g0, g1 ... wait sums g0, check, queue unpack g0, queue g2 ...

The copy stream only copies, so the DMA engine moves group k + 1 while group k is
checked and unpacked. With Triton (CUDA), the sums and the unpack of a group are one
kernel each (prefill_worker/restore_kernels.py): the load thread queues a group's work
in a few launches, far ahead of the copies. Without it, kvpool's torch sums and one
index_put per layer (pool_pack.unpack_chunks) compute the same.

A slot read in place (client.read(in_place=True): the object lives in this process's own
pool segment, registered with CUDA once) is copied to the device straight from the
segment: the same H2D copy, from the object's own address, with no Mooncake get into the
slot before it. Its checksum is computed on the device copy as for any other, and once
the copy is done its read lease must still hold (else the group ends there, a miss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.client import PoolClient
from kvpool.object_format import checksums_of_sums, payload_sums_t
from prefill_worker import restore_kernels
from prefill_worker.pool_pack import unpack_blocks, unpack_chunks
from protocol.ids import BlockId, ChunkKey

VERIFY_GROUP = 4
"""Objects copied to the device and checksummed together (one host wait per group). Two
groups' staging buffers alternate: the H2D copy of group k + 1 runs while group k is
verified and unpacked (the device holds 2 x VERIFY_GROUP payloads: 256 MiB for an 8B
model's 256-token chunks)."""


@dataclass
class _Staged:
    """A group of load slots' payloads on their way to the device: the H2D copies run on
    the copy stream (`copied` follows them), their payload sums and the sums' copy back to
    pinned host memory on the unpack stream (`summed`)."""

    group: range
    """Indices into the window's keys and slots."""
    payloads: torch.Tensor
    """[len(group), payload bytes] uint8 in one of the two staging buffers."""
    sums: torch.Tensor
    """[len(group), 2] int64 payload sums, pinned host memory (valid once `summed`)."""
    copied: torch.cuda.Event
    summed: torch.cuda.Event


class GpuRestore:
    """Owns the copy and unpack streams and the two staging buffers; load thread only
    (the step thread only records events that `stream` waits for)."""

    def __init__(self, client: PoolClient, kv_caches: list[torch.Tensor]) -> None:
        self.client = client
        self.device = kv_caches[0].device
        self.stream = torch.cuda.Stream(self.device)
        """Sums and unpacks (compute goes on beside them)."""
        self.copy_stream = torch.cuda.Stream(self.device)
        """H2D copies out of the load slots only."""
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[torch.cuda.Event | None] = [None, None]
        """Recorded after the unpacks reading each staging buffer."""
        self.kernels = restore_kernels.available(self.device)
        self._tables: dict[tuple[int, ...], restore_kernels.LayerTable] = {}
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        """(phase, start, end) events of the device work queued since the last
        `drain_times` (kvpool/metrics.py RESTORE_PHASES: h2d_gpu, checksum_gpu,
        unpack_gpu)."""

    def unpack(
        self,
        stage: int,
        keys: list[ChunkKey],
        slots: list[int],
        n: int,
        layers: list[torch.Tensor],
        block_ids: list[int],
        first: int,
        start_block: int,
    ) -> int:
        """Copy the n payloads in `slots` (chunks first, first + 1, ... of a load whose
        blocks are `block_ids`, from block 0 of the sequence) to the device in groups of
        VERIFY_GROUP, checksum each group there, compare with the headers and unpack it
        into `layers`, the next group's copy running meanwhile. Blocks before
        `start_block` (a GPU prefix ending inside a chunk) are not written. Returns how
        many leading payloads were verified and unpacked (a damaged one ends the run and is
        discarded from the pool)."""
        groups = [range(g, min(g + VERIFY_GROUP, n)) for g in range(0, n, VERIFY_GROUP)]
        if not groups:
            return 0
        spec = self.client.specs[stage]
        bs = layers[0].shape[2]
        bpc = spec.shape[2] // bs  # payload [L, P, chunk tokens, H, D]
        staged = self._stage_group(stage, slots, groups[0], 0)
        self._sum_group(staged)
        for gi in range(len(groups)):
            last = gi + 1 == len(groups)
            nxt = None if last else self._stage_group(stage, slots, groups[gi + 1], gi + 1)
            staged.summed.synchronize()
            got = checksums_of_sums(staged.sums)
            want = [self.client.stored_checksum(slots[j]) for j in staged.group]
            # The copies are done (the sums waited for them): an object read in place
            # was safe to copy only if its lease outlived the copy (if not, its bytes
            # may be another object's by now: a miss, but nothing to remove).
            held = [self.client.lease_held(slots[j]) for j in staged.group]
            ok = [a == b for a, b in zip(got, want, strict=True)]
            self.client.discard(
                stage,
                [keys[j] for j, o, h in zip(staged.group, ok, held, strict=True) if h and not o],
            )
            ok = [o and h for o, h in zip(ok, held, strict=True)]
            good = len(ok) if all(ok) else ok.index(False)
            if good < len(ok) and not held[good]:
                self.client.metrics.failure("load", "lease_expired")
            payloads = staged.payloads.view(getattr(torch, spec.dtype))
            payloads = payloads.view(len(staged.group), *spec.shape)
            with torch.cuda.stream(self.stream):
                begin = _timing_event()
                k0 = 0
                c = first + staged.group.start  # the group's first chunk
                b0 = max(start_block, c * bpc)
                if good and b0 != c * bpc:  # a partial first chunk: on its own
                    off = (b0 - c * bpc) * bs
                    ids = block_ids[b0 : (c + 1) * bpc]
                    unpack_blocks(payloads[0, :, :, off:], layers, _ids(ids))
                    k0 = 1
                if good > k0:
                    ids = block_ids[(c + k0) * bpc : (c + good) * bpc]
                    self._unpack_whole(payloads[k0:good], layers, ids)
                free = _timing_event()
                self._timed.append(("unpack_gpu", begin, free))
                self._staging_free[gi % 2] = free
            if good < len(staged.group):
                return staged.group.start + good
            if nxt is None:
                break
            self._sum_group(nxt)  # behind this group's unpacks on the unpack stream
            staged = nxt
        return n

    def _unpack_whole(
        self, payloads: torch.Tensor, layers: list[torch.Tensor], ids: list[int]
    ) -> None:
        """Whole chunks [G, L, P, n, H, D] into `ids` (chunk-major), on the unpack stream."""
        if not self.kernels:
            unpack_chunks(payloads, layers, _ids(ids))
            return
        key = tuple(kv.data_ptr() for kv in layers)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = restore_kernels.LayerTable(layers)
        idx = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        restore_kernels.unpack_chunks(payloads, table, idx)

    def _stage_group(self, stage: int, slots: list[int], group: range, k: int) -> _Staged:
        """Queue group's H2D copies into staging buffer k % 2 on the copy stream, once the
        unpacks that read that buffer last are done."""
        nbytes = self.client.specs[stage].payload_bytes
        buf = self.client.buffer
        b = k % 2
        with torch.cuda.stream(self.copy_stream):
            if not self._staging or self._staging[0].numel() < VERIFY_GROUP * nbytes:
                self.sync()  # nothing reads the old buffers any more
                self._staging = [
                    torch.empty(VERIFY_GROUP * nbytes, dtype=torch.uint8, device=self.device)
                    for _ in range(2)
                ]
            free = self._staging_free[b]
            if free is not None:
                self.copy_stream.wait_event(free)
            payloads = self._staging[b][: len(group) * nbytes].view(len(group), nbytes)
            begin = _timing_event()
            for i, j in enumerate(group):  # from the slot, or the segment (in place)
                payloads[i].copy_(buf.payload_bytes(slots[j], nbytes), non_blocking=True)
            copied = _timing_event()
            self._timed.append(("h2d_gpu", begin, copied))
        sums = torch.empty(len(group), 2, dtype=torch.int64, pin_memory=True)
        return _Staged(group, payloads, sums, copied, copied)

    def _sum_group(self, staged: _Staged) -> None:
        """On the unpack stream, once the group's copies are done: its payload sums and
        their copy to pinned host memory (`summed` follows)."""
        sums: Callable[[torch.Tensor], torch.Tensor] = payload_sums_t
        if self.kernels and staged.payloads.shape[1] % 4 == 0:
            sums = restore_kernels.payload_sums
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(staged.copied)
            begin = _timing_event()
            staged.sums.copy_(sums(staged.payloads), non_blocking=True)
            staged.summed = _timing_event()
            self._timed.append(("checksum_gpu", begin, staged.summed))

    def sync_copies(self) -> None:
        """Wait for the H2D copies out of the load slots (before the slots are reused)."""
        self.copy_stream.synchronize()

    def sync(self) -> None:
        """Wait for the copies out of the load slots and the unpacks (before a load is
        reported: nothing may still write its blocks)."""
        self.copy_stream.synchronize()
        self.stream.synchronize()

    def drain_times(self) -> dict[str, float]:
        """Seconds of device stream time per phase since the last call; call after
        `sync` (every timed event is then complete)."""
        out: dict[str, float] = {}
        for phase, begin, end in self._timed:
            out[phase] = out.get(phase, 0.0) + begin.elapsed_time(end) / 1000.0
        self._timed = []
        return out


def _timing_event() -> torch.cuda.Event:
    """An event recorded now on the current stream, with timing (restore phases)."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _ids(blocks: list[int]) -> list[BlockId]:
    return [BlockId(b) for b in blocks]

"""PoolWorker: the pool connector's worker side, one per prefill process (every PP stage).

    step thread (start_loads / start_saves)      load thread              save thread
    ───────────────────────────────────────      ───────────              ───────────
    start_loads: cancels, queue each load ──────▶ per window of chunks,
      (CUDA: an event the unpacks wait for)       per local stage: read
                                                  into load slots, verify,
                                                  unpack into the blocks
    [the stage's forward]                         done: whole leading chunks
    start_saves: pack each planned chunk of this   every local stage has
      step's KV into save slots ── queue ──────────────────────────────────▶ write
      (no free slot: not saved, reported)                                    (grouped)
    get_finished ◀── finished loads, stored / unstored chunks, counters ─────┘

Only this process's stages are read and written (`PoolClient.local_stages`: its layers).
A load's result is the leading run of chunks every local stage loaded and verified; the
scheduler side (pool_connector.py) takes the least over all stage processes, so nothing a
failing stage or chunk wrote beyond it is ever used. Packing runs in start_saves, in the
stream order of the forward that wrote the KV (so a later step reusing the blocks cannot
overwrite it first); the slow part, the write, never blocks the step thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import torch

from engine.kv_connector import KVConnectorWorker, WorkerPlace
from kvpool.client import PoolClient
from kvpool.keys import StageSpec
from kvpool.object_format import HEADER_BYTES, checksums_of_sums, payload_sums_t
from kvpool.stats import StageCounters
from prefill_worker.pool_pack import pack_blocks, unpack_blocks, unpack_chunks
from protocol.ids import BlockId, ChunkKey
from protocol.pool_messages import PoolLoad, PoolLoadDone, PoolStepMeta, PoolWorkerReport

log = logging.getLogger(__name__)

MAX_SAVE_BATCH = 32
"""Chunks written by one batch_put_from per stage."""

MAX_DEVICE_COPIES = 8
"""CUDA: packed chunks whose device copy may still be on its way to the save slots; the
step thread waits for the oldest beyond this (bounds the device memory they hold)."""

VERIFY_GROUP = 4
"""Objects copied to the device and checksummed together (one host wait per group). Two
groups' staging buffers alternate: the H2D copy of group k + 1 runs while group k is
verified and unpacked (the device holds 2 x VERIFY_GROUP payloads: 256 MiB for an 8B
model's 256-token chunks)."""

_meta_decoder = msgspec.msgpack.Decoder(PoolStepMeta)


@dataclass
class _Load:
    job: PoolLoad
    ready: torch.cuda.Event | None
    """Recorded after the work queued before the load (CUDA): unpacks wait for it, so
    they land after every earlier step's KV writes into the same blocks."""


@dataclass
class _DeviceCopy:
    """A chunk's device copy on its way into the save slots (CUDA): the D2H copies and
    the payload sums run on the save stream; `done` follows them."""

    done: torch.cuda.Event
    sums: torch.Tensor
    """[local stages, 2] payload sums (payload_sums_t), on the device."""


@dataclass
class _Staged:
    """A group of load slots' payloads on their way to the device (CUDA): the H2D copies
    run on the copy stream (`copied` follows them), their payload sums and the sums' copy
    back to pinned host memory on the unpack stream (`summed`)."""

    group: range
    """Indices into the window's keys and slots."""
    payloads: torch.Tensor
    """[len(group), payload bytes] uint8 in one of the two staging buffers."""
    sums: torch.Tensor
    """[len(group), 2] int64 payload sums, pinned host memory (valid once `summed`)."""
    copied: torch.cuda.Event
    summed: torch.cuda.Event


@dataclass
class _Save:
    key: ChunkKey
    slots: list[int]
    """One save slot per local stage, in PoolClient.local_stages order."""
    checksums: list[int | None]
    """Payload checksum of each slot computed where it was packed (None: on the host,
    when the header is written)."""
    copy: _DeviceCopy | None = None
    """CUDA: the slots are filled (and `checksums` known) once this copy is done."""


class PoolWorker(KVConnectorWorker):
    """Owns the load and save threads of one prefill process, their queues and what they
    finished since the last report. Step-thread methods as in KVConnectorWorker; the
    threads touch only the pool client, the slots and (loads) the blocks they were given."""

    def __init__(self, client: PoolClient, counters: StageCounters) -> None:
        self.client = client
        self.counters = counters
        self.chunk_size = client.chunk_size
        self.stages: list[StageSpec] = list(client.local_stages)
        self.kv_caches: list[torch.Tensor] = []
        self._layer0 = 0
        self.blocks_per_chunk = 0
        self._in_flight: set[str] = set()
        self._cancelled: set[str] = set()
        """Requests of loads in flight that are no longer wanted (guarded by _lock)."""
        self._loads: queue.Queue[_Load | None] = queue.Queue()
        self._saves: queue.Queue[_Save | None] = queue.Queue()
        self._done: list[PoolLoadDone] = []
        self._saved: list[bytes] = []
        self._unsaved: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.num_save_slots = len(client.buffer.save_slot_ids)
        self._stream: torch.cuda.Stream | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        """CUDA: the load thread's H2D copies and payload sums (unpacks: `_stream`)."""
        self._staging: list[torch.Tensor] = []
        """CUDA: two device buffers of VERIFY_GROUP payloads each (load thread)."""
        self._staging_free: list[torch.cuda.Event | None] = [None, None]
        """CUDA: recorded after the unpacks reading each staging buffer."""
        self._save_stream: torch.cuda.Stream | None = None
        self._copies: deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = deque()
        """CUDA: device copies of packed chunks, kept alive until their D2H is done."""
        self._last: tuple[bytes, PoolStepMeta | None] = (b"", None)
        self._threads: list[threading.Thread] = []

    # -- KVConnectorWorker -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        for s in self.stages:
            assert place.layer_start <= s.layer_start and s.layer_end <= place.layer_end, (
                f"pool stage {s.index} (layers {s.layer_start}-{s.layer_end}) is not in this "
                f"process's layers {place.layer_start}-{place.layer_end}"
            )
        self.kv_caches = kv_caches
        self._layer0 = place.layer_start
        block_size = kv_caches[0].shape[2]
        assert self.chunk_size % block_size == 0
        self.blocks_per_chunk = self.chunk_size // block_size
        dev = kv_caches[0].device
        # Unpacks run on their own CUDA stream (compute goes on) and are synchronized
        # before a slot is reused and before a load is reported.
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._save_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._threads = [
            threading.Thread(target=self._load_loop, name="pool-load", daemon=True),
            threading.Thread(target=self._save_loop, name="pool-save", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _decode(self, meta: bytes) -> PoolStepMeta | None:
        if not meta:
            return None
        if self._last[0] is not meta:  # start_loads and start_saves get the same bytes
            self._last = (meta, _meta_decoder.decode(meta))
        return self._last[1]

    def start_loads(self, meta: bytes) -> None:
        m = self._decode(meta)
        if m is None:
            return
        with self._lock:
            self._cancelled.update(r for r in m.cancels if r in self._in_flight)
            self._in_flight.update(job.request_id for job in m.loads)
        for job in m.loads:
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record()
            self._loads.put(_Load(job, ready))

    def start_saves(self, meta: bytes) -> None:
        m = self._decode(meta)
        if m is None or not m.saves:
            return
        buf = self.client.buffer
        for save in m.saves:
            for key, blocks in zip(save.chunk_keys, save.block_ids, strict=True):
                slots = buf.acquire_save(len(self.stages))
                if slots is None:
                    self.counters.save_dropped.inc()
                    with self._lock:
                        self._unsaved.append(key)
                    continue
                if self._save_stream is not None:
                    self._saves.put(self._pack_on_device(ChunkKey(key), slots, _ids(blocks)))
                    continue
                checksums: list[int | None] = []
                for stage, slot in zip(self.stages, slots, strict=True):
                    out = buf.payload(slot, self.client.specs[stage.index])
                    checksums.append(pack_blocks(self._layers(stage), _ids(blocks), out))
                self._saves.put(_Save(ChunkKey(key), slots, checksums))

    def _pack_on_device(self, key: ChunkKey, slots: list[int], blocks: list[BlockId]) -> _Save:
        """CUDA: gather the chunk's blocks into device payloads in the forward's stream
        order (a later step may reuse the blocks right after), then, on the save stream,
        their payload sums and the D2H copies into the pinned save slots: the step thread
        does not wait for either (the save thread does, before the write)."""
        assert self._save_stream is not None
        while self._copies and self._copies[0][0].query():
            self._copies.popleft()  # copied: their device payloads can go
        while len(self._copies) >= MAX_DEVICE_COPIES:
            self._copies.popleft()[0].synchronize()
        dev = self.kv_caches[0].device
        idx = torch.tensor(blocks, dtype=torch.long, device=dev)
        temps = []
        for stage in self.stages:
            spec = self.client.specs[stage.index]
            dst = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=dev)
            parts, _, bs, h, d = self.kv_caches[0].shape
            for layer, kv in enumerate(self._layers(stage)):
                torch.index_select(kv, 1, idx, out=dst[layer].view(parts, len(blocks), bs, h, d))
            temps.append(dst)
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._save_stream):
            self._save_stream.wait_event(ready)
            sums = torch.stack([payload_sums_t(t.view(-1).view(torch.uint8)) for t in temps])
            for t, stage, slot in zip(temps, self.stages, slots, strict=True):
                out = self.client.buffer.payload(slot, self.client.specs[stage.index])
                out.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._copies.append((done, temps))
        return _Save(key, slots, [None] * len(slots), _DeviceCopy(done, sums))

    def get_finished(self) -> bytes:
        with self._lock:
            loads, self._done = self._done, []
            saved, self._saved = self._saved, []
            unsaved, self._unsaved = self._unsaved, []
        counts = self.counters.drain()
        if not (loads or saved or unsaved) and counts.is_empty():
            return b""
        return msgspec.msgpack.encode(
            PoolWorkerReport(
                [s.index for s in self.stages],
                loads,
                saved,
                unsaved,
                self.save_queue_depth(),
                counts,
            )
        )

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()

    def wake(self) -> None:
        """End a wait now (this process's scheduler side got a lookup back)."""
        self._wake.set()

    def close(self) -> None:
        if self._threads:
            self.drain_saves(timeout_s=5.0)
            self._loads.put(None)
            self._saves.put(None)
            for t in self._threads:
                t.join(timeout=10)
            self._threads = []
        self.client.close()

    # -- helpers ----------------------------------------------------------------------------
    def _layers(self, stage: StageSpec) -> list[torch.Tensor]:
        return self.kv_caches[stage.layer_start - self._layer0 : stage.layer_end - self._layer0]

    def save_queue_depth(self) -> int:
        """Chunks packed and not yet written."""
        used = self.num_save_slots - self.client.buffer.num_free_save_slots
        return used // len(self.stages)

    def drain_saves(self, timeout_s: float) -> bool:
        """Wait until every packed chunk has been written (tests, benchmarks, shutdown);
        False if some were still pending after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.client.buffer.num_free_save_slots < self.num_save_slots:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- saves (save thread) ------------------------------------------------------------------
    def _save_loop(self) -> None:
        while True:
            job = self._saves.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < MAX_SAVE_BATCH:
                try:
                    nxt = self._saves.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._saves.put(None)
                    break
                batch.append(nxt)
            stored: set[bytes] = set()
            try:
                for b in batch:
                    if b.copy is not None:  # wait for its D2H copy; sums -> checksums
                        b.copy.done.synchronize()
                        b.checksums = list(checksums_of_sums(b.copy.sums))
                        b.copy = None
                stored = set(
                    self.client.save_chunks(
                        [b.key for b in batch],
                        [b.slots for b in batch],
                        [b.checksums for b in batch],
                    )
                )
            except Exception:  # a save must never take the worker down
                log.exception("pool save of %d chunk(s) failed", len(batch))
                self.counters.failure("save", "error", len(batch))
            finally:
                for b in batch:
                    self.client.buffer.release_save(b.slots)
            with self._lock:
                for b in batch:
                    (self._saved if b.key in stored else self._unsaved).append(bytes(b.key))
            self._wake.set()

    # -- loads (load thread) ------------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            item = self._loads.get()
            if item is None:
                return
            rid = item.job.request_id
            num_tokens = 0
            if not self._is_cancelled(rid):
                try:
                    num_tokens = self._load(item)
                except Exception:  # a failed load is a miss, never a dead worker
                    log.exception("pool load of %s failed", rid)
                    self.counters.failure("load", "error")
                finally:  # nothing may still write the blocks once the load is reported
                    self._sync_unpacks()
            with self._lock:
                self._done.append(PoolLoadDone(rid, num_tokens))
                self._in_flight.discard(rid)
                self._cancelled.discard(rid)
            self._wake.set()

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _load(self, item: _Load) -> int:
        """Read, verify and unpack every local stage's objects of the job's chunks in
        windows of load slots; returns the tokens valid from job.token_start on."""
        job = item.job
        if item.ready is not None and self._stream is not None:
            self._stream.wait_event(item.ready)
        keys = [ChunkKey(k) for k in job.chunk_keys]
        cs = self.chunk_size
        load_slots = self.client.buffer.load_slot_ids
        window = len(load_slots) // len(self.stages)
        stage_s = [0.0] * len(self.stages)
        num_ok = 0  # leading chunks of the job that every local stage has unpacked
        while num_ok < len(keys):
            if self._is_cancelled(job.request_id):
                return 0
            wkeys = keys[num_ok : num_ok + window]
            window_ok = len(wkeys)
            for i, stage in enumerate(self.stages):
                t = time.perf_counter()
                # The slots are about to be overwritten: their H2D copies must be done. The
                # previous window's last unpacks may still run (they read the device
                # staging, not the slots): they overlap this read.
                self._sync_copies()
                slots = load_slots[i * window : i * window + len(wkeys)]
                on_device = self._stream is not None
                n = self.client.read(stage.index, wkeys, slots, verify_payload=not on_device)
                n = min(n, window_ok)
                layers = self._layers(stage)
                first = job.first_chunk + num_ok  # the window's first chunk
                if on_device:
                    n = self._unpack_on_device(job, stage.index, wkeys, slots, n, first, layers)
                else:
                    n = self._unpack_on_host(job, stage.index, slots, n, first, layers)
                window_ok = n
                stage_s[i] += time.perf_counter() - t
                if n == 0:
                    break
            num_ok += window_ok
            if window_ok < len(wkeys):
                break
        for stage, secs in zip(self.stages, stage_s, strict=True):
            self.counters.restore(stage.index, secs)
            self.counters.stage_objects("load", stage.index, num_ok)
        if num_ok == 0:
            return 0
        end = min((job.first_chunk + num_ok) * cs, job.token_end)
        return end - job.token_start

    def _chunk_blocks(self, job: PoolLoad, c: int) -> tuple[int, int]:
        """Blocks [b0, b1) of chunk c that the load writes: those before token_start (a
        GPU prefix ending inside the chunk, whole blocks) are not touched."""
        bpc = self.blocks_per_chunk
        bs = self.chunk_size // bpc
        return max(job.token_start // bs, c * bpc), (c + 1) * bpc

    def _unpack_on_host(
        self, job: PoolLoad, stage: int, slots: list[int], n: int, first: int, layers: list
    ) -> int:
        """Unpack the n verified payloads in `slots` (chunks first, first + 1, ...) from
        host memory (a CPU engine: read() checked their payloads)."""
        spec = self.client.specs[stage]
        bpc = self.blocks_per_chunk
        bs = self.chunk_size // bpc
        for j in range(n):
            c = first + j
            b0, b1 = self._chunk_blocks(job, c)
            src = self.client.buffer.payload(slots[j], spec)
            unpack_blocks(src[:, :, (b0 - c * bpc) * bs :], layers, _ids(job.block_ids[b0:b1]))
        return n

    def _unpack_on_device(
        self,
        job: PoolLoad,
        stage: int,
        keys: list[ChunkKey],
        slots: list[int],
        n: int,
        first: int,
        layers: list,
    ) -> int:
        """CUDA: copy the n payloads in `slots` to the device in groups of VERIFY_GROUP,
        checksum each group there, compare with the headers and unpack the group, the next
        group's copy running meanwhile. Returns how many leading payloads were verified
        and unpacked (a damaged one ends the run and is discarded)."""
        groups = [range(g, min(g + VERIFY_GROUP, n)) for g in range(0, n, VERIFY_GROUP)]
        if not groups:
            return 0
        spec = self.client.specs[stage]
        bpc = self.blocks_per_chunk
        bs = self.chunk_size // bpc
        assert self._stream is not None
        staged = self._stage_group(stage, slots, groups[0], 0)
        self._sum_group(staged)
        for gi in range(len(groups)):
            last = gi + 1 == len(groups)
            nxt = None if last else self._stage_group(stage, slots, groups[gi + 1], gi + 1)
            staged.summed.synchronize()
            got = checksums_of_sums(staged.sums)
            want = [self.client.stored_checksum(slots[j]) for j in staged.group]
            ok = [a == b for a, b in zip(got, want, strict=True)]
            good = len(ok) if all(ok) else ok.index(False)
            self.client.discard(
                stage, [keys[j] for j, o in zip(staged.group, ok, strict=True) if not o]
            )
            payloads = staged.payloads.view(getattr(torch, spec.dtype))
            payloads = payloads.view(len(staged.group), *spec.shape)
            with torch.cuda.stream(self._stream):
                k0 = 0
                j0 = staged.group.start
                b0, b1 = self._chunk_blocks(job, first + j0)
                if good and b0 != (first + j0) * bpc:  # a partial first chunk: on its own
                    off = (b0 - (first + j0) * bpc) * bs
                    unpack_blocks(payloads[0, :, :, off:], layers, _ids(job.block_ids[b0:b1]))
                    k0 = 1
                if good > k0:
                    c0, c1 = first + j0 + k0, first + j0 + good
                    ids = job.block_ids[c0 * bpc : c1 * bpc]
                    unpack_chunks(payloads[k0:good], layers, _ids(ids))
                free = torch.cuda.Event()
                free.record()
                self._staging_free[gi % 2] = free
            if good < len(staged.group):
                return staged.group.start + good
            if nxt is None:
                break
            self._sum_group(nxt)  # behind this group's unpacks on the unpack stream
            staged = nxt
        return n

    def _stage_group(self, stage: int, slots: list[int], group: range, k: int) -> _Staged:
        """Queue group's H2D copies into staging buffer k % 2 on the copy stream, once the
        unpacks that read that buffer last are done."""
        assert self._copy_stream is not None
        nbytes = self.client.specs[stage].payload_bytes
        buf = self.client.buffer
        dev = self.kv_caches[0].device
        b = k % 2
        with torch.cuda.stream(self._copy_stream):
            if not self._staging or self._staging[0].numel() < VERIFY_GROUP * nbytes:
                self._sync_unpacks()  # nothing reads the old buffers any more
                self._staging = [
                    torch.empty(VERIFY_GROUP * nbytes, dtype=torch.uint8, device=dev)
                    for _ in range(2)
                ]
            free = self._staging_free[b]
            if free is not None:
                self._copy_stream.wait_event(free)
            payloads = self._staging[b][: len(group) * nbytes].view(len(group), nbytes)
            for i, j in enumerate(group):
                off = slots[j] * buf.slot_bytes + HEADER_BYTES
                payloads[i].copy_(buf.tensor[off : off + nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        sums = torch.empty(len(group), 2, dtype=torch.int64, pin_memory=True)
        return _Staged(group, payloads, sums, copied, copied)

    def _sum_group(self, staged: _Staged) -> None:
        """On the unpack stream, once the group's copies are done: its payload sums and
        their copy to pinned host memory (`summed` follows). The copy stream only copies,
        so the DMA engine moves the next group meanwhile."""
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(staged.copied)
            staged.sums.copy_(payload_sums_t(staged.payloads), non_blocking=True)
            staged.summed = torch.cuda.Event()
            staged.summed.record()

    def _unpack_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _sync_copies(self) -> None:
        """Wait for the H2D copies out of the load slots (CUDA)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _sync_unpacks(self) -> None:
        """Wait for the copies out of the load slots and the unpacks (CUDA)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self._stream is not None:
            self._stream.synchronize()


def _ids(blocks: list[int]) -> list[BlockId]:
    return [BlockId(b) for b in blocks]

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
overwrite it first); the slow part, the write, never blocks the step thread. On CUDA,
a window's loaded objects go to the device, are verified and unpacked there by GpuRestore
(pool_restore_gpu.py).
"""

from __future__ import annotations

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
from kvpool.object_format import checksums_of_sums, payload_sums_t
from kvpool.stats import StageCounters
from prefill_worker.pool_pack import pack_blocks, unpack_blocks
from prefill_worker.pool_restore_gpu import GpuRestore
from protocol.ids import BlockId, ChunkKey
from protocol.pool_messages import (
    PoolLoad,
    PoolLoadDone,
    PoolStepMeta,
    PoolWorkerReport,
    without_saves,
)

log = logging.getLogger(__name__)

MAX_SAVE_BATCH = 32
"""Chunks written by one batch_put_from per stage."""

MAX_DEVICE_COPIES = 8
"""CUDA: packed chunks whose device copy may still be on its way to the save slots; the
step thread waits for the oldest beyond this (bounds the device memory they hold)."""

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
        self._restore: GpuRestore | None = None
        """CUDA: the load thread's copies to the device, checks and unpacks."""
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
        # Unpacks run on their own CUDA streams (compute goes on) and are synchronized
        # before a slot is reused and before a load is reported.
        self._restore = GpuRestore(self.client, kv_caches) if dev.type == "cuda" else None
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
            if self._restore is not None:
                ready = torch.cuda.Event()
                ready.record()
            self._loads.put(_Load(job, ready))

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """Drops their saves (this stage's forward of them failed); loads stay (they
        were started before the forward)."""
        m = self._decode(meta)
        if m is None:
            return meta
        return msgspec.msgpack.encode(without_saves(m, request_ids))

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
                    t = time.perf_counter()
                    self._sync_unpacks()
                    self._count_device_times(time.perf_counter() - t)
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
        if item.ready is not None and self._restore is not None:
            self._restore.stream.wait_event(item.ready)
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
                waited = time.perf_counter() - t
                slots = load_slots[i * window : i * window + len(wkeys)]
                gpu = self._restore
                n = self.client.read(
                    stage.index, wkeys, slots, verify_payload=gpu is None, in_place=True
                )
                n = min(n, window_ok)
                layers = self._layers(stage)
                first = job.first_chunk + num_ok  # the window's first chunk
                t_dev = time.perf_counter()
                if gpu is not None:
                    start_block = job.token_start // (cs // self.blocks_per_chunk)
                    n = gpu.unpack(
                        stage.index, wkeys, slots, n, layers, job.block_ids, first, start_block
                    )
                    phase = "device"
                else:
                    n = self._unpack_on_host(job, stage.index, slots, n, first, layers)
                    n = self.client.confirm(stage.index, wkeys, slots, n)  # read in place
                    phase = "unpack"
                spent = time.perf_counter() - t_dev + waited
                self.counters.restore_phase(stage.index, phase, spent)
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

    def _count_device_times(self, waited_s: float) -> None:
        """CUDA: the final wait for a load's device work, and the device stream time of
        its phases (restore_phase_seconds; all counted on this process's first stage)."""
        if self._restore is None:
            return
        stage = self.stages[0].index
        self.counters.restore_phase(stage, "device", waited_s)
        for phase, secs in self._restore.drain_times().items():
            self.counters.restore_phase(stage, phase, secs)

    def _sync_copies(self) -> None:
        """Wait for the H2D copies out of the load slots (CUDA)."""
        if self._restore is not None:
            self._restore.sync_copies()

    def _sync_unpacks(self) -> None:
        """Wait for the copies out of the load slots and the unpacks (CUDA)."""
        if self._restore is not None:
            self._restore.sync()


def _ids(blocks: list[int]) -> list[BlockId]:
    return [BlockId(b) for b in blocks]

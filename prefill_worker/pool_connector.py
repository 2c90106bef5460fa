"""PoolConnector: the engine's KVConnector over kvpool, for one prefill instance.

    engine thread                       load thread                    save thread
    ─────────────                       ───────────                    ───────────
    admission: lookup (every stage) ─┐
    start_load ──── queue ──────────▶│ per window of chunks, per stage:
                                     │   read into load slots (size, header), copy each
                                     │   payload to the device, checksum it there,
                                     │   unpack the verified ones into the new blocks
    finished_loads ◀── LoadResult ───┘ whole leading chunks every stage has
    on_computed: pack new full prompt chunks into save slots ── queue ──▶ write (grouped)
                 no free slot: drop the chunk, count it                    free the slots

Only this instance's stages are read and written (`PoolClient.local_stages`; all of them
with PP=1). The result of a load is the leading run of chunks every stage loaded and
verified; whatever a failing stage or chunk wrote beyond it is never used (the engine
recomputes from there). Packing runs on the engine thread because a finished request's
blocks are freed right after the step; the slow part, the write, never blocks compute.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from engine.kv_connector import KVConnector, LoadResult
from engine.llm_engine import LLMEngine
from engine.request import Request
from enginehost.kv_events import KVReporter
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.object_format import (
    HEADER_BYTES,
    checksums_of_sums,
    payload_checksum_t,
    payload_sums_t,
)
from kvpool.topology import master_address
from protocol.cluster import ClusterConfig, PrefillConfig
from protocol.hashing import chunk_keys
from protocol.ids import BlockId, ChunkKey, RequestId

log = logging.getLogger(__name__)

MAX_SAVE_BATCH = 32
"""Chunks written by one batch_put_from per stage."""

VERIFY_GROUP = 8
"""Objects copied to the device and checksummed together (one host sync per group); the
device staging buffer holds this many payloads."""


@dataclass
class _Load:
    request_id: RequestId
    keys: list[ChunkKey]
    """Chunk keys of chunks first_chunk, first_chunk + 1, ..."""
    first_chunk: int
    block_ids: list[BlockId]
    token_start: int
    token_end: int


@dataclass
class _Save:
    key: ChunkKey
    slots: list[int]
    """One save slot per local stage, in PoolClient.local_stages order."""
    checksums: list[int | None]
    """Payload checksum of each slot computed on the device that packed it (None: on the
    host, when the header is written)."""


class PoolConnector(KVConnector):
    """Owns the load and save threads of one prefill instance, their queues, and which
    chunks of each live request are still to be saved. Engine-thread methods as in
    KVConnector; the threads touch only the pool client, the slots and (loads) the
    blocks they were given."""

    def __init__(
        self,
        client: PoolClient,
        kv_caches: list[torch.Tensor],
        metrics: PoolMetrics,
        *,
        on_saved: Callable[[list[ChunkKey]], None] | None = None,
        on_restored: Callable[[int, float], None] | None = None,
    ) -> None:
        """`on_saved(chunk_keys)` (save thread) and `on_restored(bytes, seconds)` (load
        thread) tell the worker's KV reporter what the pool now holds and how fast
        restores run (KV-aware routing)."""
        self.client = client
        self.kv_caches = kv_caches
        self.metrics = metrics
        self._on_saved = on_saved
        self._on_restored = on_restored
        self.chunk_size = client.chunk_size
        block_size = kv_caches[0].shape[2]
        assert self.chunk_size % block_size == 0
        self.blocks_per_chunk = self.chunk_size // block_size
        self._next_save: dict[RequestId, int] = {}
        self._in_flight: set[RequestId] = set()
        self._cancelled: set[RequestId] = set()
        """Requests that finished while their load was in flight (guarded by _lock)."""
        self._loads: queue.Queue[_Load | None] = queue.Queue()
        self._saves: queue.Queue[_Save | None] = queue.Queue()
        self._done: list[LoadResult] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.num_save_slots = len(client.buffer.save_slot_ids)
        dev = kv_caches[0].device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        """Unpacks run on their own CUDA stream (compute goes on) and are synchronized
        before a slot is reused and before a load is reported."""
        self._staging: torch.Tensor | None = None
        """Device copies of up to VERIFY_GROUP payloads (load thread; CUDA only)."""
        self._threads = [
            threading.Thread(target=self._load_loop, name="pool-load", daemon=True),
            threading.Thread(target=self._save_loop, name="pool-save", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _keys(self, request: Request, first: int, end: int) -> list[ChunkKey]:
        bpc = self.blocks_per_chunk
        hashes = request.block_hashes[first * bpc : end * bpc]
        return [ChunkKey(bytes(h)) for h in chunk_keys(hashes, bpc)]

    # -- scheduler side (engine thread) ----------------------------------------------------
    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        cs = self.chunk_size
        # Whole prompt chunks before the last token (its logits must be computed).
        last = min((request.num_tokens - 1) // cs, request.num_prompt_tokens // cs)
        first = num_computed_tokens // cs
        if first >= last:
            return 0
        n = self.client.lookup(self._keys(request, first, last))
        return (first + n) * cs - num_computed_tokens if n else 0

    def start_load(
        self, request: Request, block_ids: list[BlockId], token_start: int, token_end: int
    ) -> None:
        cs = self.chunk_size
        assert token_start % (cs // self.blocks_per_chunk) == 0, "a GPU prefix is whole blocks"
        first, end = token_start // cs, -(-token_end // cs)
        with self._lock:
            self._in_flight.add(request.request_id)
        self._loads.put(
            _Load(
                request.request_id,
                self._keys(request, first, end),
                first,
                list(block_ids),
                token_start,
                token_end,
            )
        )

    def finished_loads(self) -> list[LoadResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()

    def request_finished(self, request: Request) -> None:
        self._next_save.pop(request.request_id, None)
        with self._lock:
            if request.request_id in self._in_flight:
                self._cancelled.add(request.request_id)

    # -- saves (engine thread packs, save thread writes) -------------------------------------
    def on_computed(
        self, request: Request, token_start: int, token_end: int, block_ids: list[BlockId]
    ) -> None:
        if not self.client.backend.accepts_writes:
            return  # the pool is off ("none" backend): nothing to pack
        cs = self.chunk_size
        rid = request.request_id
        # The first computed token marks where the request's hits ended: chunks before
        # it came from the GPU cache or the pool and are not saved again.
        nxt = self._next_save.setdefault(rid, token_start // cs)
        last = min(token_end, request.num_prompt_tokens) // cs
        if nxt >= last:
            return
        keys = self._keys(request, nxt, last)
        stages = self.client.local_stages
        bpc = self.blocks_per_chunk
        for key, c in zip(keys, range(nxt, last), strict=True):
            slots = self.client.buffer.acquire_save(len(stages))
            if slots is None:
                self.metrics.save_dropped.inc()
                continue
            blocks = list(block_ids[c * bpc : (c + 1) * bpc])
            checksums: list[int | None] = []
            for stage, slot in zip(stages, slots, strict=True):
                out = self.client.buffer.payload(slot, self.client.specs[stage.index])
                layers = self.kv_caches[stage.layer_start : stage.layer_end]
                checksums.append(pack_blocks(layers, blocks, out))
            self._saves.put(_Save(key, slots, checksums))
        self._next_save[rid] = last
        self._set_depth()

    def _set_depth(self) -> None:
        used = self.num_save_slots - self.client.buffer.num_free_save_slots
        self.metrics.save_queue_depth.set(used // len(self.client.local_stages))

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
            try:
                self._write(batch)
            except Exception:  # a save must never take the worker down
                log.exception("pool save of %d chunk(s) failed", len(batch))
                self.metrics.failure("save", "error", len(batch))
            finally:
                for b in batch:
                    self.client.buffer.release_save(b.slots)
                self._set_depth()

    def _write(self, batch: list[_Save]) -> None:
        stored = self.client.save_chunks(
            [b.key for b in batch], [b.slots for b in batch], [b.checksums for b in batch]
        )
        if stored and self._on_saved is not None:
            self._on_saved(stored)

    # -- loads (load thread) ------------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            num_tokens = 0
            if job.request_id not in self._cancelled:
                try:
                    num_tokens = self._load(job)
                except Exception:  # a failed load is a miss, never a dead worker
                    log.exception("pool load of %s failed", job.request_id)
                    self.metrics.failure("load", "error")
            with self._lock:
                self._done.append(LoadResult(job.request_id, num_tokens))
                self._in_flight.discard(job.request_id)
                self._cancelled.discard(job.request_id)
            self._wake.set()

    def _load(self, job: _Load) -> int:
        """Read, verify and unpack every local stage's objects of the job's chunks in
        windows of load slots; returns the tokens valid from job.token_start on."""
        cs = self.chunk_size
        bpc = self.blocks_per_chunk
        bs = cs // bpc
        stages = self.client.local_stages
        load_slots = self.client.buffer.load_slot_ids
        window = len(load_slots) // len(stages)
        t0 = time.perf_counter()
        stage_s = [0.0] * len(stages)
        num_ok = 0  # leading chunks of the job that every stage has unpacked
        while num_ok < len(job.keys):
            if job.request_id in self._cancelled:
                return 0
            keys = job.keys[num_ok : num_ok + window]
            window_ok = len(keys)
            for i, stage in enumerate(stages):
                t = time.perf_counter()
                self._sync_unpacks()  # the slots are about to be overwritten
                slots = load_slots[i * window : i * window + len(keys)]
                on_device = self._stream is not None
                n = self.client.read(stage.index, keys, slots, verify_payload=not on_device)
                n = min(n, window_ok)
                spec = self.client.specs[stage.index]
                layers = self.kv_caches[stage.layer_start : stage.layer_end]
                g0 = 0
                while g0 < n:
                    group = range(g0, min(g0 + VERIFY_GROUP, n))
                    srcs = [self.client.buffer.payload(slots[j], spec) for j in group]
                    if on_device:
                        srcs = self._verified_copies(stage.index, keys, slots, group)
                    for j, src in zip(group, srcs, strict=False):
                        # Blocks [b0, b1) of chunk c are the load's; those before
                        # token_start (a GPU prefix ending inside the chunk, whole blocks)
                        # are not touched.
                        c = job.first_chunk + num_ok + j
                        b0 = max(job.token_start // bs, c * bpc)
                        b1 = (c + 1) * bpc
                        with self._unpack_stream():
                            unpack_blocks(
                                src[:, :, (b0 - c * bpc) * bs :], layers, job.block_ids[b0:b1]
                            )
                    if len(srcs) < len(group):  # a damaged payload: the run ends before it
                        n = group.start + len(srcs)
                        break
                    g0 = group.stop
                self._sync_unpacks()
                window_ok = n
                stage_s[i] += time.perf_counter() - t
                if n == 0:
                    break
            num_ok += window_ok
            if window_ok < len(keys):
                break
        for stage, secs in zip(stages, stage_s, strict=True):
            self.metrics.restore_seconds.labels(
                instance=self.metrics.instance, stage=str(stage.index)
            ).observe(secs)
        elapsed = time.perf_counter() - t0
        self.metrics.restore_wait_seconds.observe(elapsed)
        if num_ok == 0:
            return 0
        if self._on_restored is not None:
            nbytes = sum(self.client.specs[s.index].object_bytes for s in stages) * num_ok
            self._on_restored(nbytes, elapsed)
        end = min((job.first_chunk + num_ok) * cs, job.token_end)
        tokens = end - job.token_start
        self.metrics.restored_tokens.inc(tokens)
        return tokens

    def _verified_copies(
        self, stage: int, keys: list[ChunkKey], slots: list[int], group: range
    ) -> list[torch.Tensor]:
        """Copy the payloads of slots[j] (j in group) to the device staging buffer, checksum
        each there, compare with its header's value; returns the device payloads
        ([L_s, 2, n, H, D]) of the leading verified ones. Mismatching objects are damaged:
        counted and removed (client.discard)."""
        assert self._stream is not None
        spec = self.client.specs[stage]
        buf = self.client.buffer
        nbytes = spec.payload_bytes
        dev = self.kv_caches[0].device
        with torch.cuda.stream(self._stream):
            if self._staging is None or self._staging.numel() < VERIFY_GROUP * nbytes:
                self._staging = torch.empty(VERIFY_GROUP * nbytes, dtype=torch.uint8, device=dev)
            staged = self._staging[: len(group) * nbytes].view(len(group), nbytes)
            for k, j in enumerate(group):
                off = slots[j] * buf.slot_bytes + HEADER_BYTES
                staged[k].copy_(buf.tensor[off : off + nbytes], non_blocking=True)
            got = checksums_of_sums(payload_sums_t(staged))  # syncs the stream
        want = [self.client.stored_checksum(slots[j]) for j in group]
        ok = [g == w for g, w in zip(got, want, strict=True)]
        bad = [keys[j] for j, good in zip(group, ok, strict=True) if not good]
        self.client.discard(stage, bad)
        dtype = getattr(torch, spec.dtype)
        n = len(ok) if all(ok) else ok.index(False)
        return [staged[k].view(dtype).view(spec.shape) for k in range(n)]

    def drain_saves(self, timeout_s: float) -> bool:
        """Wait until every packed chunk has been written (tests, benchmarks, shutdown);
        False if some were still pending after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.client.buffer.num_free_save_slots < self.num_save_slots:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _unpack_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _sync_unpacks(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        self.drain_saves(timeout_s=5.0)
        self._loads.put(None)
        self._saves.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self.client.close()


def pack_blocks(
    layers: list[torch.Tensor], block_ids: list[BlockId], out: torch.Tensor
) -> int | None:
    """Copy whole blocks of `layers` into `out`, a contiguous [L, 2, n, H, D] payload with
    n = len(block_ids) * block_size (token t of it = block block_ids[t // bs], offset
    t % bs): one index_select per layer, through a device temporary for a GPU cache.
    Returns the payload checksum (payload_checksum_t) computed on the device before the
    D2H copy for a device cache; None for a host cache (the save thread's write_header
    computes it there, off the engine thread).

        kv[l]: [2, num_blocks, bs, H, D] --index_select(dim 1, block_ids)--> out[l] viewed
                                                                          [2, nblk, bs, H, D]
    """
    dev = layers[0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    dst = out if out.device == dev else torch.empty(out.shape, dtype=out.dtype, device=dev)
    _, _, bs, h, d = layers[0].shape
    for layer, kv in enumerate(layers):
        torch.index_select(kv, 1, idx, out=dst[layer].view(2, len(block_ids), bs, h, d))
    if dst is out:
        return None
    checksum = payload_checksum_t(dst.view(-1).view(torch.uint8))
    out.copy_(dst)
    return checksum


def unpack_blocks(src: torch.Tensor, layers: list[torch.Tensor], block_ids: list[BlockId]) -> None:
    """Inverse of pack_blocks: src [L, 2, len(block_ids) * bs, H, D] into those blocks."""
    dev = layers[0].device
    if src.device != dev:
        src = src.to(dev, non_blocking=True)
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    _, _, bs, h, d = layers[0].shape
    for layer, kv in enumerate(layers):
        kv.index_copy_(1, idx, src[layer].reshape(2, len(block_ids), bs, h, d))


def build_pool_connector(
    cluster: ClusterConfig,
    inst: PrefillConfig,
    engine: LLMEngine,
    registry: CollectorRegistry,
    reporter: KVReporter | None = None,
) -> PoolConnector:
    """The prefill instance's connector: the "mooncake" backend on its node's master
    (shared or split pool), or the "none" backend when the pool is off."""
    pool = cluster.pool
    node = cluster.node(inst.node)
    metrics = PoolMetrics(registry, inst.name)
    if pool is not None and pool.enabled:
        config = BackendConfig(node.host, master_address(cluster, inst.node), pool.protocol)
        backend = create_backend("mooncake", config)
        buffer_bytes: int | None = int(inst.pool_buffer_memory)
        depth = pool.save_queue_depth
    else:
        backend = create_backend("none", BackendConfig(node.host, ""))
        buffer_bytes, depth = None, 1
    client = PoolClient(
        backend,
        engine.namespace,
        engine.layout,
        buffer_bytes=buffer_bytes,
        max_save_chunks=depth,
        metrics=metrics,
        pin_memory=engine.device.type == "cuda",
    )
    return PoolConnector(
        client,
        engine.runner.kv_caches,
        metrics,
        on_saved=reporter.record_pool_saved if reporter is not None else None,
        on_restored=reporter.record_restore if reporter is not None else None,
    )

"""The pool as a KV connector (engine/kv_connector.py): PoolScheduler, the scheduler side
on stage 0, over one PoolWorker per prefill process (pool_worker.py), for PP = 1 and PP > 1.

    stage 0 engine thread (PoolScheduler)              every stage's process (PoolWorker)
    admission: lookup over EVERY stage (hit rule,  ─┐
      on the lookup thread; None until it is back)  │
    update_state_after_alloc: plan the load        │
    build_step_meta: PoolStepMeta ─────────────────┼──▶ start_loads: its stages' objects
      loads, cancels, new full prompt chunks as    │    start_saves: pack its layers
      save slots allow (pool_save_queue.py)        │
    update_from_workers ◀── PoolWorkerReport ──────┴─── get_finished (with the step result)
      a load is done when EVERY stage reported it:
      valid tokens = the least over stages;
      a chunk is saved when every stage stored it;
      counters -> this instance's PoolMetrics

All stages read and write in parallel, each its own layers from its own process, so a
chunk is a hit only when every stage holds its object (PoolClient.lookup), and a restore
uses only the chunks every stage loaded and verified: never partial data. A request that
finishes while its load is in flight keeps its blocks (request_finished -> True) until
every stage reported the load (cancelled early), then they are released.

Beside it: pool_lookups.py (the lookup thread: lookups and retention's removals),
pool_save_queue.py (chunks waiting for a save slot), pool_build.py (the client and the
retention policy from cluster.yaml), pool_worker.py (each process's worker side).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import torch
from prometheus_client import CollectorRegistry

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_connector import ConnectorUpdate, KVConnectorScheduler, StepKV
from engine.request import Request, RequestStatus
from enginehost.kv_events import KVReporter
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.retention import Retention
from kvpool.stats import StageCounters
from prefill_worker.pool_build import build_pool_client, build_retention
from prefill_worker.pool_lookups import PoolLookups
from prefill_worker.pool_pack import pack_blocks, unpack_blocks
from prefill_worker.pool_save_queue import QueuedChunk, ResidentChunks, SaveQueue
from prefill_worker.pool_worker import PoolWorker
from protocol.cluster import ClusterConfig, PoolInstance
from protocol.hashing import chunk_keys
from protocol.ids import BlockHash, BlockId, ChunkKey, RequestId
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace
from protocol.pool_messages import (
    PoolLoad,
    PoolSave,
    PoolStepMeta,
    PoolWorkerReport,
    without_saves,
)

__all__ = [
    "PoolScheduler",
    "PoolWorker",
    "build_pool_client",
    "build_pool_connector",
    "build_retention",
    "pack_blocks",
    "unpack_blocks",
]

_report_decoder = msgspec.msgpack.Decoder(PoolWorkerReport)
_meta_decoder = msgspec.msgpack.Decoder(PoolStepMeta)


@dataclass
class _LoadState:
    job: PoolLoad
    started: float
    reported: dict[int, int] = field(default_factory=dict)
    """Worker (stage process) index -> valid tokens it reported."""
    cancelled: bool = False


@dataclass
class _SaveState:
    expected: int = 0
    """Reports still due (one per worker per time the chunk was planned)."""
    all_stored: bool = True
    depth: int = 0
    """The chunk's index in its request's chain (retention: tail first)."""
    stamp: float = 0.0
    """Use stamp of the request that saves it (retention: recency)."""
    request_id: str = ""


class PoolScheduler(KVConnectorScheduler):
    """Owns the instance's pool decisions: lookups, planned loads and saves, loads and
    saves in flight on the workers, and the instance's pool metrics. Engine thread only.

    `client` is stage 0's PoolClient (its lookups cover every stage); `num_workers` the
    number of processes with a PoolWorker (the pipeline's stages; 1 without PP)."""

    def __init__(
        self,
        client: PoolClient,
        metrics: PoolMetrics,
        block_size: int,
        num_workers: int = 1,
        *,
        on_saved: Callable[[list[ChunkKey]], None] | None = None,
        on_restored: Callable[[int, float], None] | None = None,
        on_removed: Callable[[list[ChunkKey]], None] | None = None,
        wake: Callable[[], None] | None = None,
        retention: Retention | None = None,
        save_mode: str = "through",
    ) -> None:
        """`on_saved(chunk_keys)`, `on_removed(chunk_keys)` and `on_restored(bytes,
        seconds)` tell the worker's KV reporter what the pool now holds (saved, or
        removed by this instance's retention) and how fast restores run (KV-aware
        routing);
        `wake()` ends the engine's idle wait when a lookup is back (this process's
        worker's `wake`); `retention` picks the chunks this instance removes itself
        (kvpool/retention.py; default: none, the master evicts); `save_mode` (pool.save)
        "through" saves chunks once computed, "victim" when the GPU cache evicts them."""
        self.client = client
        self.metrics = metrics
        self.num_workers = num_workers
        self.chunk_size = client.chunk_size
        assert self.chunk_size % block_size == 0
        self.blocks_per_chunk = self.chunk_size // block_size
        self.saves_enabled = client.backend.accepts_writes
        self._on_saved = on_saved
        self._on_restored = on_restored
        self._on_removed = on_removed
        self.save_queue = SaveQueue(
            len(client.buffer.save_slot_ids) // len(client.local_stages), num_workers
        )
        """Computed chunks waiting for a save slot on every worker (pool_save_queue.py)."""
        assert save_mode in ("through", "victim"), save_mode
        self.save_mode = save_mode
        self.resident: ResidentChunks | None = None
        """save_mode victim: computed chunks only the GPU cache holds (bind_block_pool)."""
        self._block_pool: BlockPool | None = None
        self._object_bytes = sum(spec.object_bytes for spec in client.specs.values())
        self._next_save: dict[RequestId, int] = {}
        self._planned: list[PoolLoad] = []
        self._cancels: list[str] = []
        self._failed_loads: list[tuple[int, str]] = []
        """(worker, request) whose load a failed worker call skipped (workers_failed)."""
        self._loads: dict[str, _LoadState] = {}
        self._saving: dict[bytes, _SaveState] = {}
        self._depth: dict[int, int] = {}
        self.retention = retention if retention is not None else Retention()
        self._stamps: dict[RequestId, float] = {}
        """Use stamp of each request (retention): its first lookup's time."""
        self.lookups = PoolLookups(client, self.retention, on_removed, wake)
        """Lookups and retention's removals, on their own thread (pool_lookups.py)."""

    def _keys(self, request: Request, first: int, end: int) -> list[ChunkKey]:
        bpc = self.blocks_per_chunk
        hashes = request.block_hashes[first * bpc : end * bpc]
        return [ChunkKey(bytes(h)) for h in chunk_keys(hashes, bpc)]

    # -- admission --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        cs = self.chunk_size
        # Whole prompt chunks before the last token (its logits must be computed).
        last = min((request.num_tokens - 1) // cs, request.num_prompt_tokens // cs)
        first = num_computed_tokens // cs
        rid = request.request_id
        if rid not in self._stamps:  # its whole chain is in use from now on
            self._stamps[rid] = time.monotonic()
            self.retention.used(self._keys(request, 0, last), 0, self._stamps[rid])
        answer = self.lookups.matched(
            rid,
            first,
            last,
            num_computed_tokens,
            lambda f, e: self._keys(request, f, e),
            self._stamps[rid],
        )
        return answer, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        self.lookups.forget(request.request_id)  # admitted: its answer is used
        if num_external_tokens == 0:
            return
        cs = self.chunk_size
        start = request.num_computed_tokens
        end = start + num_external_tokens
        assert start % (cs // self.blocks_per_chunk) == 0, "a GPU prefix is whole blocks"
        first, last = start // cs, -(-end // cs)
        job = PoolLoad(
            request.request_id,
            [bytes(k) for k in self._keys(request, first, last)],
            first,
            [int(b) for b in block_ids],
            start,
            end,
        )
        self._planned.append(job)
        self._loads[job.request_id] = _LoadState(job, time.perf_counter())

    # -- each step ----------------------------------------------------------------------------
    def bind_block_pool(self, pool: BlockPool) -> None:
        """Chunks that wait for a save slot after their request let go of its blocks are
        found in the engine's prefix cache (pool_save_queue.py); save_mode victim hears
        its evictions."""
        self._block_pool = pool
        self.save_queue.bind(pool.lookup)
        if self.save_mode == "victim" and self.saves_enabled:
            self.resident = ResidentChunks(2 * pool.num_blocks // self.blocks_per_chunk)
            pool.on_evict = self._evicted

    def saves_on_eviction(self) -> bool:
        return self.resident is not None

    def _evicted(self, pairs: list[tuple[BlockId, BlockHash]]) -> None:
        assert self.resident is not None and self._block_pool is not None
        self.resident.evicted(pairs, self._block_pool.lookup)

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        for kv in computed:
            self._plan_save(kv)
        victims = self._take_victims() if self.resident is not None else []
        saves = []
        if len(self.save_queue):
            took = self.save_queue.take()
            saves = took.saves
            for c in took.taken:
                st = self._saving.setdefault(c.key, _SaveState())
                st.expected += self.num_workers
                st.depth, st.stamp, st.request_id = c.depth, max(st.stamp, c.stamp), c.request_id
            m = self.metrics
            m.save_deferred.inc(took.num_deferred)
            if took.num_evicted:
                m.save_lost.labels(instance=m.instance, reason="evicted").inc(took.num_evicted)
            if took.num_behind_hole:
                m.save_lost.labels(instance=m.instance, reason="chain").inc(took.num_behind_hole)
            m.save_waiting.set(len(self.save_queue))
        if not (self._planned or self._cancels or saves or victims):
            return b""
        meta = PoolStepMeta(self._planned, self._cancels, saves, victims)
        self._planned, self._cancels = [], []
        return msgspec.msgpack.encode(meta)

    def _take_victims(self) -> list[PoolSave]:
        """Chunks the GPU cache evicted while this step was scheduled: saved now (packed
        before the step's forward overwrites their blocks) if every worker has a slot,
        else lost."""
        assert self.resident is not None
        due, self.resident.due = self.resident.due, []
        lost, self.resident.num_lost = self.resident.num_lost, 0
        saves, no_slot = self.save_queue.take_now(due)
        now = time.monotonic()  # recency: when it left the GPU cache
        for c in due[: len(saves)]:
            st = self._saving.setdefault(c.key, _SaveState())
            st.expected += self.num_workers
            st.depth, st.stamp, st.request_id = c.depth, now, c.request_id
        m = self.metrics
        m.save_deferred.inc(len(saves))
        if lost + no_slot:
            m.save_lost.labels(instance=m.instance, reason="evicted").inc(lost + no_slot)
        return saves

    def _plan_save(self, kv: StepKV) -> None:
        """Queue the whole prompt chunks this step completes, from where the request's
        hits ended (chunks before its first computed token came from the GPU cache or
        the pool); they leave the queue as save slots allow."""
        if not self.saves_enabled:
            return
        cs = self.chunk_size
        rid = kv.request.request_id
        nxt = self._next_save.setdefault(rid, kv.token_start // cs)
        last = min(kv.token_end, kv.request.num_prompt_tokens) // cs
        if nxt >= last:
            return
        self._next_save[rid] = last
        bpc = self.blocks_per_chunk
        keys = [bytes(k) for k in self._keys(kv.request, nxt, last)]
        stamp = self._stamps.setdefault(rid, time.monotonic())
        hashes = kv.request.block_hashes
        to = self.resident if self.resident is not None else self.save_queue
        to.add(
            [
                QueuedChunk(
                    rid,
                    k,
                    c,
                    [int(b) for b in kv.block_ids[c * bpc : (c + 1) * bpc]],
                    [BlockHash(bytes(h)) for h in hashes[c * bpc : (c + 1) * bpc]],
                    stamp,
                )
                for c, k in enumerate(keys, nxt)
            ]
        )

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """Their chunks are not saved (their KV of this step is not valid): no report of
        those saves will come, so they are no longer expected."""
        if not meta:
            return meta
        m = _meta_decoder.decode(meta)
        kept = without_saves(m, request_ids)
        for save in m.saves:
            if save.request_id not in request_ids:
                continue
            self.save_queue.withdrawn(len(save.chunk_keys))
            for key in save.chunk_keys:
                st = self._saving.get(key)
                if st is not None:
                    st.expected -= self.num_workers
                    if st.expected <= 0:
                        del self._saving[key]
        if not (kept.loads or kept.cancels or kept.saves or kept.victims):
            return b""
        return msgspec.msgpack.encode(kept)

    def workers_failed(self, meta: bytes, error: str, process: int) -> set[RequestId]:
        """Worker `process` skipped or broke off the step's loads and saves
        (engine/kv_connector_guard.py): its loads count as restoring nothing (the
        requests recompute without the pool once every worker reported), its saves as
        not stored (no chunk of them counts as saved). Nobody fails."""
        if not meta:
            return set()
        m = _meta_decoder.decode(meta)
        self._failed_loads += [(process, load.request_id) for load in m.loads]
        for save in m.saves:
            for key in save.chunk_keys:
                st = self._saving.get(key)
                if st is not None:
                    st.all_stored = False
                    st.expected -= 1
                    if st.expected <= 0:
                        del self._saving[key]
        return set()

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        assert len(reports) == self.num_workers, (
            f"{len(reports)} pool worker reports, {self.num_workers} expected"
        )
        out = ConnectorUpdate()
        for worker, rid in self._failed_loads:  # before the reports: theirs come later
            self._load_reported(worker, rid, 0, out)
        self._failed_loads.clear()
        saved: list[ChunkKey] = []
        for worker, raw in enumerate(reports):
            if not raw:
                continue
            report = _report_decoder.decode(raw)
            self.metrics.apply(report.counts)
            self._depth[worker] = report.save_queue_depth
            self.save_queue.reported(worker, len(report.saved) + len(report.unsaved))
            for done in report.loads:
                self._load_reported(worker, done.request_id, done.num_tokens, out)
            for key, ok in [(k, True) for k in report.saved] + [(k, False) for k in report.unsaved]:
                st = self._saving.get(key)
                if st is None:
                    continue
                st.expected -= 1
                st.all_stored &= ok
                if st.expected <= 0:
                    del self._saving[key]
                    if st.all_stored:
                        saved.append(ChunkKey(key))
                        self.retention.saved(ChunkKey(key), st.depth, st.stamp)
                    else:  # a hole: the request's later chunks need no slot
                        live = st.request_id in self._next_save
                        self.save_queue.lost(st.request_id, st.depth, live=live)
        if self._depth:
            self.metrics.save_queue_depth.set(max(self._depth.values()))
        if saved:
            self.metrics.save_chunks.inc(len(saved))
            if self._on_saved is not None:
                self._on_saved(saved)
            victims = self.retention.victims()
            if victims:  # removed on the lookup thread (a network call)
                self.metrics.retention_removed.inc(len(victims))
                self.lookups.remove_later(victims)
                if self._on_removed is not None:
                    self._on_removed(victims)
            self.metrics.retained_chunks.set(self.retention.num_chunks)
        return out

    def _load_reported(self, worker: int, rid: str, tokens: int, out: ConnectorUpdate) -> None:
        st = self._loads.get(rid)
        if st is None:
            return
        st.reported[worker] = tokens
        if len(st.reported) < self.num_workers:
            return
        del self._loads[rid]
        if st.cancelled:
            out.released.add(RequestId(rid))
            return
        valid = max(0, min(st.reported.values()))
        elapsed = time.perf_counter() - st.started
        self.metrics.restore_wait_seconds.observe(elapsed)
        out.finished_loads[RequestId(rid)] = valid
        if valid:
            self.metrics.restored_tokens.inc(valid)
            if self._on_restored is not None:
                cs = self.chunk_size
                chunks = -(-(st.job.token_start + valid) // cs) - st.job.first_chunk
                self._on_restored(chunks * self._object_bytes, elapsed)

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        rid = request.request_id
        finished = request.status is not RequestStatus.WAITING  # not preempted
        self.save_queue.released(rid, finished=finished)
        if finished:
            self._next_save.pop(rid, None)
            self._stamps.pop(rid, None)
            self.lookups.forget(rid)
        st = self._loads.get(rid)
        if st is None:
            return False
        if not st.cancelled:
            st.cancelled = True
            self._cancels.append(rid)
        return True

    def has_pending(self) -> bool:
        looking = self.lookups.in_flight()
        return bool(looking or self._loads or self._saving or self._cancels or len(self.save_queue))

    def close(self) -> None:
        self.lookups.close()


def build_pool_connector(
    cluster: ClusterConfig,
    inst: PoolInstance,
    namespace: KVNamespace,
    layout: KVLayout,
    config: EngineConfig,
    registry: CollectorRegistry,
    reporter: KVReporter | None = None,
) -> tuple[PoolScheduler, PoolWorker]:
    """Stage 0's pool connector: the scheduler side over every stage's worker, and its
    own worker (stage 0's layers; every layer with PP = 1)."""
    pp = inst.pipeline_parallel
    counters = StageCounters()
    client = build_pool_client(
        cluster,
        inst,
        namespace,
        layout,
        counters,
        0 if pp > 1 else None,
        torch.device(config.device),
    )
    worker = PoolWorker(client, counters)
    scheduler = PoolScheduler(
        client,
        PoolMetrics(registry, inst.name),
        config.block_size,
        pp,
        on_saved=reporter.record_pool_saved if reporter is not None else None,
        on_restored=reporter.record_restore if reporter is not None else None,
        on_removed=reporter.record_pool_removed if reporter is not None else None,
        wake=worker.wake,
        retention=build_retention(cluster, inst, client),
        save_mode=cluster.pool.save if cluster.pool is not None else "through",
    )
    return scheduler, worker

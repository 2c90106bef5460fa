"""KVReporter: a worker's KV events and load, served to the router (protocol/kv_events.py).

    engine thread: BlockPool events (stored / removed / cleared) ─┐ drained on each poll
    pool side:     pool_saved / pool_removed(chunk keys), restore ┤ and every DRAIN_S
                                                                  ▼
    ring of KVEvent (seq numbered, bounded)
        ── GET /kv_events/stream?since=N&epoch=E&interval_s=T ──▶ router (pushed: one
           NDJSON KVEventBatch as soon as there are events, at most every T seconds, and
           a heartbeat with the load every HEARTBEAT_S; the connection stays open)
        ── GET /kv_events?since=N&epoch=E ──▶ one batch (tests, tools)
    GET /info ─▶ WorkerInfo (namespace key, block/chunk size, bytes per token, capacity)

Recording starts with the first subscriber or read (a worker nobody routes by never pays
for it), and a background task drains the block pool every DRAIN_S so that a consumer
that went away cannot make it grow without bound. A consumer that fell behind the ring
gets a snapshot instead (`reset`).

Measured rates (what kv_aware routing prices with):
- compute: prompt tokens computed per second of engine busy time, over the last
  RATE_WINDOW_S of samples (the scheduler counts a request's tokens when it is admitted,
  so a short window would spike);
- restore: pool bytes per second of load time, EWMA over what the pool connector reports
  through `record_restore`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.block_pool import BlockPoolEvent
from engine.llm_engine import LLMEngine
from enginehost.host import EngineHost
from protocol.ids import ChunkKey
from protocol.kv_events import KVEvent, KVEventBatch, KVEventKind, WorkerInfo, WorkerLoad

DRAIN_S = 1.0
HEARTBEAT_S = 1.0
"""A stream with no events still sends the load this often (the gate reads it)."""
MIN_PUSH_S = 0.01
RING_EVENTS = 65536
RATE_WINDOW_S = 30.0
MIN_BUSY_S = 0.2
"""Busy time a compute rate needs before it is reported."""
RESTORE_EWMA = 0.2
_KINDS: dict[str, KVEventKind] = {"stored": "stored", "removed": "removed", "cleared": "cleared"}


class ComputeRate:
    """Prompt tokens per busy second from (time, tokens, busy_s) samples. Engine thread."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int, float]] = deque()
        self.last: float | None = None

    def sample(self, tokens_total: int, busy_s_total: float) -> float | None:
        """The rate over the window ending now; the previous one while too little ran."""
        now = time.monotonic()
        self._samples.append((now, tokens_total, busy_s_total))
        while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
            self._samples.popleft()
        _, tok0, busy0 = self._samples[0]
        if busy_s_total - busy0 >= MIN_BUSY_S and tokens_total > tok0:
            self.last = (tokens_total - tok0) / (busy_s_total - busy0)
        return self.last


class KVReporter:
    """Owns one worker's event ring, its epoch and its measured rates."""

    def __init__(
        self, name: str, role: str, host: EngineHost, *, record_block_events: bool
    ) -> None:
        self.name = name
        self.role = role
        self.host = host
        self.epoch = uuid.uuid4().hex
        self.record_block_events = record_block_events
        self._ring: deque[KVEvent] = deque(maxlen=RING_EVENTS)
        self._next_seq = 0
        self._lock = threading.Lock()
        self._compute = ComputeRate()
        self._restore_bps: float | None = None
        self._drainer: asyncio.Task[None] | None = None
        self.info = self._worker_info(host.engine)

    # -- any thread -------------------------------------------------------------------------
    def record_pool_saved(self, chunk_keys: Sequence[ChunkKey]) -> None:
        """Chunks this instance wrote to the pool (called by the pool connector)."""
        if chunk_keys:
            self._append("pool_saved", [bytes(k) for k in chunk_keys])

    def record_pool_removed(self, chunk_keys: Sequence[ChunkKey]) -> None:
        """Chunks this instance removed from the pool (its retention): no longer hits."""
        if chunk_keys:
            self._append("pool_removed", [bytes(k) for k in chunk_keys])

    def record_restore(self, num_bytes: int, seconds: float) -> None:
        """One finished pool load: its bytes and how long it took."""
        if num_bytes <= 0 or seconds <= 0:
            return
        bps = num_bytes / seconds
        with self._lock:
            prev = self._restore_bps
            self._restore_bps = bps if prev is None else prev + RESTORE_EWMA * (bps - prev)

    def _append(self, kind: KVEventKind, hashes: list[bytes]) -> None:
        with self._lock:
            self._ring.append(KVEvent(self._next_seq, kind, hashes))
            self._next_seq += 1

    # -- engine thread ------------------------------------------------------------------------
    def _worker_info(self, e: LLMEngine) -> WorkerInfo:
        return WorkerInfo(
            name=self.name,
            role=self.role,
            namespace_key=e.namespace.key(),
            block_size=e.config.block_size,
            chunk_size=e.namespace.chunk_size,
            kv_bytes_per_token=e.layout.bytes_per_token,
            kv_capacity_tokens=e.pool.num_blocks * e.config.block_size,
        )

    def _drain(self, e: LLMEngine) -> None:
        if not self.record_block_events:
            return
        e.pool.record_events = True
        merged: list[BlockPoolEvent] = []
        for ev in e.pool.drain_events():
            if merged and merged[-1].kind == ev.kind and ev.kind != "cleared":
                merged[-1].block_hashes.extend(ev.block_hashes)
            else:
                merged.append(BlockPoolEvent(ev.kind, list(ev.block_hashes)))
        for ev in merged:
            self._append(_KINDS[ev.kind], [bytes(h) for h in ev.block_hashes])

    def load(self, e: LLMEngine) -> WorkerLoad:
        sched = e.scheduler
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        c = e.counters
        rate = self._compute.sample(
            c.prompt_tokens_computed + c.recomputed_tokens, self.host.loop.busy_s
        )
        with self._lock:
            restore = self._restore_bps
        return WorkerLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.loading),
            queued_tokens=queued,
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
            compute_tokens_per_s=rate,
            restore_bytes_per_s=restore,
        )

    def _batch(self, e: LLMEngine, since: int, epoch: str) -> KVEventBatch:
        self._drain(e)
        load = self.load(e)
        with self._lock:
            first = self._ring[0].seq if self._ring else self._next_seq
            behind = epoch != self.epoch or since < first or since > self._next_seq
            events = [] if behind else [ev for ev in self._ring if ev.seq >= since]
            next_seq = self._next_seq
        snapshot: list[bytes] = []
        if behind and self.record_block_events:
            snapshot = [bytes(h) for h in e.pool.cached_hashes()]
        return KVEventBatch(
            epoch=self.epoch,
            next_seq=next_seq,
            reset=behind,
            snapshot=snapshot,
            events=events,
            load=load,
        )

    # -- event loop -----------------------------------------------------------------------------
    def install(self, app: FastAPI) -> None:
        """Add GET /info and GET /kv_events to a worker's app."""
        info_body = msgspec.json.encode(self.info)

        @app.get("/info")
        async def info() -> Response:
            return Response(info_body, media_type="application/json")

        @app.get("/kv_events")
        async def kv_events(request: Request) -> Response:
            q = request.query_params
            try:
                since = int(q.get("since", "0"))
            except ValueError:
                since = -1
            epoch = q.get("epoch", "")
            self._start_drainer()
            batch = await self.host.call(functools.partial(self._batch, since=since, epoch=epoch))
            return Response(msgspec.json.encode(batch), media_type="application/json")

        @app.get("/kv_events/stream")
        async def kv_events_stream(request: Request) -> Response:
            q = request.query_params
            try:
                since = int(q.get("since", "0"))
                interval_s = max(MIN_PUSH_S, float(q.get("interval_s", "0.05")))
            except ValueError:
                since, interval_s = -1, 0.05
            self._start_drainer()
            return StreamingResponse(
                self._push(since, q.get("epoch", ""), interval_s),
                media_type="application/x-ndjson",
            )

    async def _push(self, since: int, epoch: str, interval_s: float) -> AsyncIterator[bytes]:
        """One subscriber's stream: a batch whenever there is news (events, a reset, or a
        changed load), a heartbeat otherwise, checked every interval_s."""
        last_sent = -HEARTBEAT_S
        last_load = None
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.host.call(functools.partial(self._batch, since=since, epoch=epoch))
            now = loop.time()
            news = batch.events or batch.reset or batch.load != last_load
            if news or now - last_sent >= HEARTBEAT_S:
                yield msgspec.json.encode(batch) + b"\n"
                last_sent, last_load = now, batch.load
            since, epoch = batch.next_seq, batch.epoch
            await asyncio.sleep(interval_s)

    def _start_drainer(self) -> None:
        if self._drainer is None:
            self._drainer = asyncio.get_running_loop().create_task(self._drain_forever())

    async def _drain_forever(self) -> None:
        while True:
            await asyncio.sleep(DRAIN_S)
            await self.host.call(self._drain)

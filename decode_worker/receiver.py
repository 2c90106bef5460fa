"""Decode's side of the handoff as a KV connector: a request waits for prefill's KV inside
the engine (WAITING_FOR_KV), never in an HTTP polling loop.

    /decode ─ expect(rid, landing region) ─ add_request ─▶ scheduler admits it:
        get_num_new_matched_tokens = the prompt past decode's own prefix (async)
        update_state_after_alloc: pages reserved ─▶ on_ready: DecodeReady to the router
    prefill ─ SegmentsLanded ─▶ landed(): queued ─▶ build_step_meta: PieceScatter to every
        rank ─▶ LandingWorker.start_loads scatters ring bytes into the pages (before the
        step's forward) ─▶ update_from_workers: every rank did it ─▶ the notice is answered
        (prefill may write those ring bytes again)
    prefill ─ PrefillFirstToken ─▶ the engine appends the token to the waiting request
    every flow landed + first token ─▶ finished_loads: the request runs from its first
        token (computing that token's KV samples the second)

A failed flow (FlowClosed with an error) ends the load short: the engine recomputes the
prompt from the last token every rank and layer holds (the first token is prefill's, so
the output is the same). The landing region goes back to the arena only when no write
into it can be in flight: every flow landed in full, or every prefill stage closed its
flow, or no prefill was ever contacted, or the quarantine (the transport's write timeout)
passed after an abort.

Note on the contract: decode's load covers the whole rest of the prompt (not "before the
last token"): the first token comes from prefill and is appended before the load is
reported, so the request still has a token to compute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count

import msgspec
import torch

from decode_worker.landing_check import segment_problem
from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.request import Request
from protocol.handoff_messages import PieceScatter, ScatterMeta, ScatterReport
from protocol.ids import BlockId, RequestId
from protocol.kv_layout import KVLayout
from protocol.messages import FlowClosed, SegmentsLanded
from transfer import FULL, KVShard, LandingArena, LandingRegion, scatter_segments
from transfer.flows import FlowCoverage

log = logging.getLogger(__name__)

_meta = msgspec.msgpack.Decoder(ScatterMeta)
_report = msgspec.msgpack.Decoder(ScatterReport)


@dataclass
class _Piece:
    piece_id: int
    notice: SegmentsLanded
    answer: Future[bool]
    """True once every rank scattered it; False when the request is gone."""


@dataclass
class RemoteKV:
    """One request whose prompt KV comes from prefill (rank 0's view)."""

    request_id: str
    region: LandingRegion
    num_prompt_tokens: int
    on_ready: Callable[[], None]
    coverage: FlowCoverage
    block_ids: list[int] | None = None
    skip_below: int = 0
    first_token: bool = False
    error: str | None = None
    queued: list[_Piece] = field(default_factory=list)
    in_step: dict[int, _Piece] = field(default_factory=dict)
    num_stages: int | None = None
    closed_stages: set[int] = field(default_factory=set)
    reported: bool = False
    scatter_failed_from: int | None = None
    """The first prompt token of a piece whose scatter failed (on any rank): the KV
    from there on is not in every rank's pages, whatever landed."""
    aborted_at: float | None = None
    region_freed: bool = False
    num_bytes: int = 0

    @property
    def loading(self) -> bool:
        return self.block_ids is not None and not self.reported and self.aborted_at is None


class HandoffReceiver(KVConnectorScheduler):
    """Owns the RemoteKV of every request waiting for prefill (rank 0). Scheduler-side
    methods run on the engine thread; expect / landed / closed / abort on the event loop;
    a lock guards what both touch."""

    def __init__(
        self,
        arena: LandingArena,
        num_ranks: int,
        layout: KVLayout,
        stripes: list[tuple[int, int]] | None = None,
    ) -> None:
        """`stripes[r]`: rank r's (dcp_size, dcp_rank); None: no DCP."""
        self.arena = arena
        self.num_ranks = num_ranks
        self.layout = layout
        self.stripes = stripes or [(1, 0)] * num_ranks
        self._cond = threading.Condition()
        self._remotes: dict[str, RemoteKV] = {}
        self._failed_calls: dict[int, str] = {}
        """Pieces of a step whose worker call failed (workers_failed), engine thread."""
        self._pieces = count()
        self.on_flow_closed: Callable[[FlowClosed], None] = lambda _n: None

    # -- event loop ---------------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        region: LandingRegion,
        num_prompt_tokens: int,
        on_ready: Callable[[], None],
    ) -> None:
        """The request's KV will come from prefill into `region`; `on_ready` is called
        (engine thread) once its pages are reserved."""
        cov = FlowCoverage(self.num_ranks, self.layout.num_layers, num_prompt_tokens)
        with self._cond:
            self._remotes[request_id] = RemoteKV(
                request_id, region, num_prompt_tokens, on_ready, cov
            )

    def landing_problem(self, notice: SegmentsLanded) -> str | None:
        """Why the notice's segments do not all lie inside the region reserved for its
        request (decode_worker/landing_check.py), or None (also for a request this
        instance does not hold: `landed` answers that one)."""
        with self._cond:
            r = self._remotes.get(notice.request_id)
            nbytes = None if r is None else r.region.nbytes
        if nbytes is None:
            return None
        for seg in notice.segments:
            problem = segment_problem(seg, nbytes, self.layout, self.stripes)
            if problem is not None:
                return problem
        return None

    def landed(self, notice: SegmentsLanded) -> Future[bool]:
        """Queue a landed piece for scatter; the future answers the notice."""
        answer: Future[bool] = Future()
        with self._cond:
            r = self._remotes.get(notice.request_id)
            if r is None or r.aborted_at is not None or r.block_ids is None or r.reported:
                answer.set_result(False)
                return answer
            for seg in notice.segments:
                problem = r.coverage.check(seg)
                if problem is not None:
                    r.error = r.error or f"bad KV segment from prefill: {problem}"
                    answer.set_result(False)
                    self._cond.notify_all()
                    return answer
                r.coverage.add(seg)
            r.num_stages = notice.num_stages
            r.num_bytes += sum(s.num_bytes for s in notice.segments)
            r.queued.append(_Piece(next(self._pieces), notice, answer))
            self._cond.notify_all()
        return answer

    def closed(self, notice: FlowClosed) -> None:
        """A prefill stage sends nothing more for the request."""
        self.on_flow_closed(notice)
        with self._cond:
            r = self._remotes.get(notice.request_id)
            if r is None:
                return  # landed in full and done: nothing was waiting for this
            r.num_stages = notice.num_stages
            r.closed_stages.add(notice.stage)
            if notice.error is not None and not r.coverage.complete:
                r.error = r.error or notice.error
            self._maybe_free_region(r)
            self._cond.notify_all()

    def abort(self, request_id: str, prefill_contacted: bool) -> None:
        """The router gave the request up (the engine aborted it already)."""
        with self._cond:
            r = self._remotes.get(request_id)
            if r is None:
                return
            self._abandon(r)
            if not prefill_contacted:
                self._free_region(r)  # no prefill ever had the landing: nothing in flight

    def reap(self, quarantine_s: float) -> list[str]:
        """Free regions of requests given up longer than `quarantine_s` ago whose flows
        never closed (a prefill that died mid-write). Returns their ids."""
        now = time.monotonic()
        with self._cond:
            late = [
                r
                for r in self._remotes.values()
                if r.aborted_at is not None and now - r.aborted_at > quarantine_s
            ]
            for r in late:
                self._free_region(r)
        return [r.request_id for r in late]

    def holds(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._remotes

    # -- engine thread: the scheduler side -----------------------------------------------------
    def first_token(self, request_id: str) -> bool:
        """The engine appended prefill's first token to the request. False if unknown."""
        with self._cond:
            r = self._remotes.get(request_id)
            if r is None or r.aborted_at is not None:
                return False
            r.first_token = True
            self._cond.notify_all()
            return True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        with self._cond:
            r = self._remotes.get(request.request_id)
            if r is None or r.block_ids is not None:
                return 0, False  # not a handoff, or recomputed after a preemption
            return max(0, r.num_prompt_tokens - num_computed_tokens), True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        with self._cond:
            r = self._remotes.get(request.request_id)
            if r is None:
                return
            r.block_ids = [int(b) for b in block_ids]
            r.skip_below = request.num_computed_tokens
        r.on_ready()

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        scatters = []
        with self._cond:
            for r in self._remotes.values():
                if not r.queued or r.block_ids is None:
                    continue
                for p in r.queued:
                    scatters.append(
                        PieceScatter(
                            p.piece_id,
                            r.request_id,
                            r.region.offset_bytes,
                            r.region.nbytes,
                            r.block_ids,
                            p.notice.segments,
                            r.skip_below,
                        )
                    )
                    r.in_step[p.piece_id] = p
                r.queued = []
        return msgspec.msgpack.encode(ScatterMeta(scatters)) if scatters else b""

    def workers_failed(self, meta: bytes, error: str, process: int) -> set[RequestId]:
        """The step's pieces count as failed scatters (engine/kv_connector_guard.py):
        their requests recompute from the tokens every rank holds, as after a failed
        flow, and their notices are answered False. Nobody fails."""
        if meta:
            for p in _meta.decode(meta).scatters:
                self._failed_calls[p.piece_id] = f"{error} (decode rank {process})"
        return set()

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        decoded = [_report.decode(b) for b in reports if b]
        failed = {pid: why for rep in decoded for pid, why in rep.failed}
        failed.update(self._failed_calls)
        self._failed_calls.clear()
        done = set.intersection(*(set(rep.done) for rep in decoded)) if decoded else set()
        update = ConnectorUpdate()
        with self._cond:
            for r in list(self._remotes.values()):
                for pid in [p for p in r.in_step if p in done or p in failed]:
                    piece = r.in_step.pop(pid)
                    if pid in failed:
                        r.error = r.error or f"scatter of landed KV failed: {failed[pid]}"
                        start = min(seg.token_start for seg in piece.notice.segments)
                        if r.scatter_failed_from is None or start < r.scatter_failed_from:
                            r.scatter_failed_from = start
                    piece.answer.set_result(pid not in failed)
                if self._ready(r):
                    r.reported = True
                    landed = r.coverage.landed_tokens if r.error is None else self._safe(r)
                    update.finished_loads[RequestId(r.request_id)] = max(0, landed - r.skip_below)
                    if r.error is not None:
                        log.warning(
                            "handoff of %s fell short, recomputing: %s", r.request_id, r.error
                        )
                self._maybe_free_region(r)
                self._maybe_forget(r)
        return update

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        with self._cond:
            r = self._remotes.get(request.request_id)
            if r is not None and not r.reported:
                self._abandon(r)
            elif r is not None:
                self._maybe_forget(r)
        return False  # scatters run inside steps: nothing touches the pages after this

    def has_pending(self) -> bool:
        with self._cond:
            return any(r.loading or r.queued or r.in_step for r in self._remotes.values())

    def wait(self, timeout_s: float) -> None:
        """Rank 0's idle poll: wake when a notice arrives."""
        with self._cond:
            if not any(r.queued or self._ready(r) for r in self._remotes.values()):
                self._cond.wait(timeout_s)

    def close(self) -> None:
        with self._cond:
            for r in self._remotes.values():
                self._abandon(r)

    # -- under the lock ------------------------------------------------------------------------
    def _ready(self, r: RemoteKV) -> bool:
        """The load can be reported: first token in, nothing queued or scattering, and
        every flow landed (or one failed)."""
        if not r.loading or not r.first_token or r.queued or r.in_step:
            return False
        return r.coverage.complete or r.error is not None

    def _safe(self, r: RemoteKV) -> int:
        """Tokens every rank and layer holds after a failure (whole blocks): landed, and
        below any piece whose scatter failed."""
        bs = self.layout.block_size
        held = r.coverage.landed_tokens
        if r.scatter_failed_from is not None:
            held = min(held, r.scatter_failed_from)
        return held // bs * bs

    def _abandon(self, r: RemoteKV) -> None:
        if r.aborted_at is None:
            r.aborted_at = time.monotonic()
        for p in r.queued + list(r.in_step.values()):
            if not p.answer.done():
                p.answer.set_result(False)
        r.queued, r.in_step = [], {}
        self._maybe_free_region(r)
        self._maybe_forget(r)
        self._cond.notify_all()

    def _maybe_free_region(self, r: RemoteKV) -> None:
        if r.region_freed or r.in_step:
            return
        all_closed = r.num_stages is not None and len(r.closed_stages) >= r.num_stages
        landed = r.coverage.complete and not r.queued
        if landed or (all_closed and (r.aborted_at is not None or r.reported or r.error)):
            self._free_region(r)

    def _free_region(self, r: RemoteKV) -> None:
        if not r.region_freed:
            r.region_freed = True
            self.arena.free(r.request_id)
        self._maybe_forget(r)

    def _maybe_forget(self, r: RemoteKV) -> None:
        if r.region_freed and (r.reported or r.aborted_at is not None):
            self._remotes.pop(r.request_id, None)


class LandingWorker(KVConnectorWorker):
    """Every decode rank: scatters its segments of landed pieces from its own landing
    buffer into its pages, in start_loads (before the step's forward)."""

    def __init__(
        self,
        arena: LandingArena,
        layout: KVLayout,
        rank: int,
        receiver: HandoffReceiver | None = None,
        on_scatter: Callable[[float], None] = lambda _s: None,
    ) -> None:
        self.arena, self.layout, self.rank = arena, layout, rank
        self.receiver = receiver
        """Rank 0's receiver, whose notices wake the idle engine (other ranks: None)."""
        self.on_scatter = on_scatter
        self.kv_caches: list[torch.Tensor] = []
        self.stripe: KVShard = FULL
        self._done: list[int] = []
        self._failed: list[tuple[int, str]] = []
        self._scattered: torch.cuda.Event | None = None
        """A landing on the GPU: recorded after the step's scatters, waited for before
        they are reported (prefill rewrites those ring bytes once they are)."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        self.kv_caches = kv_caches
        if place.shard is not None:
            self.stripe = KVShard(dcp_size=place.shard.dcp_size, dcp_rank=place.shard.dcp_rank)

    def start_loads(self, meta: bytes) -> None:
        if not meta:
            return
        for p in _meta.decode(meta).scatters:
            started = time.perf_counter()
            try:
                region = self.arena.mirror(p.request_id, p.offset_bytes, p.nbytes)
                mine = [s for s in p.segments if s.rank == self.rank]
                scatter_segments(
                    region,
                    mine,
                    self.layout,
                    self.kv_caches,
                    p.block_table,
                    self.stripe,
                    p.skip_below,
                )
            except Exception as e:  # a bad piece fails its request only
                log.exception("scatter of %s failed", p.request_id)
                self._failed.append((p.piece_id, f"{type(e).__name__}: {e}"))
                continue
            self._done.append(p.piece_id)
            self.on_scatter(time.perf_counter() - started)
        if self.arena.buffer.is_cuda:
            self._scattered = torch.cuda.Event()
            self._scattered.record(torch.cuda.current_stream(self.arena.buffer.device))

    def start_saves(self, meta: bytes) -> None:
        return None

    def get_finished(self) -> bytes:
        if self._scattered is not None:  # after the step's forward: long done by now
            self._scattered.synchronize()
            self._scattered = None
        if not self._done and not self._failed:
            return msgspec.msgpack.encode(ScatterReport())
        report = ScatterReport(self._done, self._failed)
        self._done, self._failed = [], []
        return msgspec.msgpack.encode(report)

    def wait(self, timeout_s: float) -> None:
        if self.receiver is not None:
            self.receiver.wait(timeout_s)
        else:
            time.sleep(timeout_s)

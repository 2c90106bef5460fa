"""Prefill side of the handoff, off the engine thread: one HandoffSender per process that
holds KV (every pipeline stage), sending its layers of every request to every decode rank.

    engine thread        submit(rid, [a, b), block table)  ── never waits, never does I/O
        │ (GPU: an event recorded after the step's KV writes)
        ▼
    packer thread        cuts [a, b) into pieces that fit a staging slot and half the
                         stage's landing ring (transfer/ring.py); waits for ring space
                         (decode's acknowledgements), never for the engine; gathers the
                         piece of each decode rank into a staging slot (kv_pack)
        ▼
    writer thread        Transport.write of each slot (ops <= 8 MiB), slot back to the ring
        ▼                of staging slots; a failed write fails this request only
    notifier threads     (one per decode instance) SegmentsLanded -> decode scatters into
                         the request's pages and answers -> ring space freed; at the end
                         FlowClosed (done, failed or aborted): decode may reuse the region

The engine keeps the request's blocks until `finished()` reports its flow closed: the
packer reads them until then. `cancel` (abort, decode gone) stops new writes; the flow
closes once no write is in flight, so decode's fence is exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from protocol.messages import FlowClosed, HandoffNotice, KVSegment, LandingInfo, SegmentsLanded
from protocol.parallel import stripe_len
from transfer.errors import PackLayoutError, TransferError
from transfer.faults import HandoffFaults
from transfer.flows import shard_of
from transfer.kv_pack import cache_geometry, gather_rows, packed_view, slots_for, torch_dtype
from transfer.ring import RingSpace, stage_ring
from transfer.send_state import Flow, Piece, SendResult, Write
from transfer.transport import Transport

log = logging.getLogger(__name__)

Notify = Callable[[str, HandoffNotice], bool]
"""POST a notice to decode's notify URL: True when decode took it, False when the request
is gone there (stop sending). Raises on a transport-level failure (treated as gone)."""

NUM_STAGING_SLOTS = 4


class HandoffSender:
    """Owns a registered staging buffer cut into slots, the live flows of this stage and
    the threads that move them (module docstring). submit / open / finished: engine
    thread; cancel: any thread."""

    def __init__(
        self,
        transport: Transport,
        staging_bytes: int,
        kv_caches: list[torch.Tensor],
        layers: tuple[int, int],
        *,
        stage: int = 0,
        num_stages: int = 1,
        notify: Notify,
        faults: HandoffFaults | None = None,
        num_slots: int = NUM_STAGING_SLOTS,
    ) -> None:
        if staging_bytes < num_slots * 4096:
            raise PackLayoutError(
                f"staging size {staging_bytes} is too small for {num_slots} slots"
            )
        self.transport = transport
        self.kv_caches = kv_caches
        self.layers = layers
        self.stage, self.num_stages = stage, num_stages
        self.notify = notify
        self.faults = faults or HandoffFaults()
        self.device = kv_caches[0].device
        _, self.block_size, self.num_heads, self.row_width = cache_geometry(kv_caches)
        self.num_parts = kv_caches[0].shape[0]
        """Cache parts per layer: 2 (K, V) or 1 (an MLA latent)."""
        self.slot_bytes = staging_bytes // num_slots // 4096 * 4096
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.staging = torch.empty(
            self.slot_bytes * num_slots, dtype=torch.uint8, device=self.device, pin_memory=pin
        )
        transport.register_tensor(self.staging)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Condition()
        self._flows: dict[str, Flow] = {}
        self._free_slots: deque[int] = deque(range(num_slots))
        self._writes: deque[Write] = deque()
        self._notices: dict[str, deque[tuple[Flow, HandoffNotice, Piece | None]]] = {}
        self._notifiers: dict[str, threading.Thread] = {}
        self._finished: list[SendResult] = []
        self._stop = False
        self._threads = [
            threading.Thread(target=self._pack_loop, name="handoff-pack", daemon=True),
            threading.Thread(target=self._write_loop, name="handoff-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- engine thread ----------------------------------------------------------------------
    def open(
        self,
        request_id: str,
        landing: list[LandingInfo],
        num_prompt_tokens: int,
        notify_url: str,
    ) -> None:
        """Start a request's flow: its KV goes to `landing` (one per decode rank)."""
        if not landing:
            raise PackLayoutError(f"request {request_id}: no landing to send to")
        for info in landing:
            self._check_layout(info)
        num_layers = landing[0].layout.num_layers
        start, size = stage_ring(landing[0].capacity_bytes, self.layers, num_layers)
        per_token = (self.layers[1] - self.layers[0]) * landing[0].layout.bytes_per_token_per_layer
        if min(size // 2, self.slot_bytes) < per_token:
            raise PackLayoutError(
                f"request {request_id}: the landing region ({landing[0].capacity_bytes} "
                f"bytes) leaves stage {self.stage} a ring of {size} bytes, less than two "
                f"tokens of its layers ({per_token} bytes each): raise the decode landing size"
            )
        flow = Flow(
            request_id,
            list(landing),
            num_prompt_tokens,
            notify_url,
            [RingSpace(size) for _ in landing],
            start,
        )
        with self._lock:
            self._flows[request_id] = flow

    def submit(
        self, request_id: str, token_start: int, token_end: int, block_table: list[int], last: bool
    ) -> None:
        """KV of tokens [token_start, token_end) is computed (this step): send it. `last`:
        nothing more follows for this request. Returns at once."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            flow = self._flows.get(request_id)
            if flow is None or flow.closed:
                return
            if token_end > token_start:
                flow.pending.append((token_start, token_end, list(block_table), ready))
            flow.last_submitted = flow.last_submitted or last
            self._maybe_close(flow)
            self._lock.notify_all()

    def finished(self) -> list[SendResult]:
        """Flows closed since the last call (done, failed or cancelled)."""
        with self._lock:
            out, self._finished = self._finished, []
            return out

    def wait_finished(self, timeout_s: float) -> None:
        """Sleep until a flow closed (finished() has news) or timeout_s passed."""
        with self._lock:
            if not self._finished:
                self._lock.wait(timeout_s)

    def in_flight(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._flows

    # -- any thread -----------------------------------------------------------------------
    def cancel(self, request_id: str, reason: str = "aborted") -> None:
        """Stop sending (abort, or decode no longer wants it); the flow closes as soon as
        no write of it is in flight."""
        with self._lock:
            flow = self._flows.get(request_id)
            if flow is not None and not flow.cancelled:
                flow.cancelled = True
                flow.error = flow.error or reason
                flow.pending.clear()
                self._maybe_close(flow)
                self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        for t in self._threads + list(self._notifiers.values()):
            t.join(timeout=5)
        self.transport.unregister_buffer(self.staging.data_ptr())

    # -- packer -----------------------------------------------------------------------------
    def _check_layout(self, info: LandingInfo) -> None:
        layout = info.layout
        h0, h1 = shard_of(info).heads(self.num_heads)
        l0, l1 = self.layers
        if (
            len(self.kv_caches) != l1 - l0
            or not 0 <= l0 < l1 <= layout.num_layers
            or h1 - h0 != layout.num_kv_heads
            or self.row_width != layout.row_width
            or self.num_parts != layout.num_parts
            or self.kv_caches[0].dtype != torch_dtype(layout)
        ):
            raise PackLayoutError(
                f"landing layout {layout} does not match the cache: {len(self.kv_caches)} "
                f"layers as [{l0}, {l1}), heads [{h0}, {h1}), row width {self.row_width}, "
                f"{self.kv_caches[0].dtype}"
            )
        if info.transport != self.transport.name:
            raise PackLayoutError(
                f"landing wants transport {info.transport!r}, this sender has "
                f"{self.transport.name!r}"
            )

    def _next_piece(self) -> tuple[Flow, Piece, list[int], object, list[int]] | None:
        """Under the lock: the first flow (submission order) whose next piece fits its
        ring on every rank, with the piece reserved there."""
        nl = self.layers[1] - self.layers[0]
        for flow in self._flows.values():
            if flow.cancelled or flow.packing or not flow.pending:
                continue
            a, b, table, ready = flow.pending[0]
            layout = flow.landing[0].layout
            per_token = nl * layout.bytes_per_token_per_layer
            dcp = max(info.dcp_size for info in flow.landing)
            budget = min(flow.rings[0].size // 2, self.slot_bytes) // per_token
            end = min(b, a + max(1, budget) * dcp - (dcp - 1))
            sizes = [
                stripe_len(a, end, info.dcp_size, info.dcp_rank) * per_token
                for info in flow.landing
            ]
            offsets = []
            for ring, nbytes in zip(flow.rings, sizes, strict=True):
                off = ring.place(max(nbytes, 1))
                if off is None:
                    break
                offsets.append(off)
            if len(offsets) < len(sizes):
                for ring in flow.rings[: len(offsets)]:
                    ring.release_newest()
                continue
            if end == b:
                flow.pending.popleft()
            else:
                flow.pending[0] = (end, b, table, ready)
            flow.packing = True
            flow.unacked += 1
            return flow, Piece(a, end), table, ready, offsets
        return None

    def _pack_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (job := self._next_piece()) is None:
                    self._lock.wait()
                if self._stop or job is None:
                    return
            flow, piece, table, ready, offsets = job
            try:
                self._pack(flow, piece, table, ready, offsets)
            except Exception as e:  # a bad piece fails its request only
                log.exception("handoff of %s: packing failed", flow.request_id)
                self._fail(flow, f"packing the KV failed: {e}")
            finally:
                with self._lock:
                    flow.packing = False
                    self._maybe_close(flow)
                    self._lock.notify_all()

    def _pack(
        self, flow: Flow, piece: Piece, table: list[int], ready: object, offsets: list[int]
    ) -> None:
        l0, l1 = self.layers
        nl = l1 - l0
        layout = flow.landing[0].layout
        dtype = torch_dtype(layout)
        piece.writes_left = len(flow.landing)
        queued = 0
        try:
            for info, off in zip(flow.landing, offsets, strict=True):
                self._pack_rank(flow, piece, table, ready, info, off, nl, l0, l1, dtype)
                queued += 1
        except BaseException:
            with self._lock:  # the writes never queued will not count the piece down
                piece.writes_left -= len(flow.landing) - queued
                if piece.writes_left == 0:
                    flow.unacked -= 1
            raise

    def _pack_rank(
        self,
        flow: Flow,
        piece: Piece,
        table: list[int],
        ready: object,
        info: LandingInfo,
        off: int,
        nl: int,
        l0: int,
        l1: int,
        dtype: torch.dtype,
    ) -> None:
        """Gather the piece of one decode rank into a staging slot, queue its write."""
        layout = info.layout
        shard = shard_of(info)
        h0, h1 = shard.heads(self.num_heads)
        n = shard.num_tokens(piece.token_start, piece.token_end)
        nbytes = n * nl * layout.bytes_per_token_per_layer
        landing_off = flow.ring_start + off
        piece.segments.append(
            KVSegment(piece.token_start, piece.token_end, landing_off, nbytes, info.rank, l0, l1)
        )
        slot = self._take_slot()
        if slot is None:
            raise TransferError("the sender is closing")
        if n:
            base = slot * self.slot_bytes
            rows = self.num_parts * nl
            out = packed_view(self.staging, base, (rows, n, h1 - h0, self.row_width), dtype)
            positions = shard.tokens(piece.token_start, piece.token_end)
            self._gather(table, positions, (h0, h1), out, ready)
        with self._lock:
            flow.writes_in_flight += 1
            self._writes.append(
                Write(
                    flow,
                    piece,
                    slot,
                    info.peer,
                    info.peer_incarnation,
                    info.buffer_addr + landing_off,
                    nbytes,
                )
            )
            self._lock.notify_all()

    def _gather(
        self,
        table: list[int],
        positions: torch.Tensor,
        heads: tuple[int, int],
        out: torch.Tensor,
        ready: object,
    ) -> None:
        if self._stream is None:
            slots = slots_for(table, self.block_size, positions, self.device)
            gather_rows(self.kv_caches, slots, heads, 0, out)
            return
        with torch.cuda.stream(self._stream):
            assert isinstance(ready, torch.cuda.Event)
            self._stream.wait_event(ready)  # after the step that wrote these blocks
            slots = slots_for(table, self.block_size, positions, self.device)
            gather_rows(self.kv_caches, slots, heads, 0, out)
        self._stream.synchronize()  # this thread waits, never the engine's

    def _take_slot(self) -> int | None:
        with self._lock:
            while not self._free_slots and not self._stop:
                self._lock.wait()
            return None if self._stop else self._free_slots.popleft()

    # -- writer -----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._writes:
                    self._lock.wait()
                if self._stop:
                    return
                w = self._writes.popleft()
                skip = w.flow.cancelled
            error = None
            started = time.perf_counter()
            num_ops = 0
            if not skip and w.nbytes:
                try:
                    self.faults.before_write(w.flow.num_prompt_tokens, w.piece.token_start)
                    local = self.staging.data_ptr() + w.slot * self.slot_bytes
                    self.transport.note_peer(w.peer, w.peer_incarnation)
                    num_ops = self.transport.write(w.peer, local, w.remote_addr, w.nbytes).num_ops
                except TransferError as e:
                    error = f"KV handoff to decode failed (prefill stage {self.stage}): {e}"
                    log.warning("handoff of %s: %s", w.flow.request_id, error)
            seconds = time.perf_counter() - started
            with self._lock:
                self._free_slots.append(w.slot)
                flow = w.flow
                flow.writes_in_flight -= 1
                flow.seconds += seconds
                if error is not None and flow.error is None:
                    flow.error = error
                    flow.cancelled = True
                    flow.pending.clear()
                if not skip and error is None:
                    flow.num_bytes += w.nbytes
                    flow.num_ops += num_ops
                w.piece.writes_left -= 1
                if w.piece.writes_left == 0 and not flow.cancelled:
                    notice = SegmentsLanded(
                        flow.request_id, self.stage, self.num_stages, w.piece.segments
                    )
                    self._post(flow, notice, w.piece)
                elif w.piece.writes_left == 0:
                    flow.unacked -= 1
                self._maybe_close(flow)
                self._lock.notify_all()

    # -- notifiers ----------------------------------------------------------------------------
    def _post(self, flow: Flow, notice: HandoffNotice, piece: Piece | None) -> None:
        """Under the lock: queue a notice for the flow's decode instance, in order."""
        url = flow.notify_url
        queue = self._notices.get(url)
        if queue is None:
            queue = self._notices[url] = deque()
            t = threading.Thread(
                target=self._notify_loop, args=(url,), name="handoff-notify", daemon=True
            )
            self._notifiers[url] = t
            t.start()
        queue.append((flow, notice, piece))

    def _notify_loop(self, url: str) -> None:
        queue = self._notices[url]
        while True:
            with self._lock:
                while not self._stop and not queue:
                    self._lock.wait()
                if self._stop:
                    return
                flow, notice, piece = queue.popleft()
            try:
                ok = self.notify(url, notice)
            except Exception as e:  # decode unreachable: this request cannot finish
                log.warning("handoff notice for %s to %s failed: %s", flow.request_id, url, e)
                ok = False
            with self._lock:
                if piece is not None:
                    flow.unacked -= 1
                    if ok:
                        for ring in flow.rings:
                            ring.release_oldest()
                    elif not flow.cancelled:
                        flow.cancelled = True
                        flow.error = flow.error or "decode no longer holds the request"
                        flow.pending.clear()
                self._maybe_close(flow)
                self._lock.notify_all()

    # -- closing ----------------------------------------------------------------------------
    def _fail(self, flow: Flow, error: str) -> None:
        with self._lock:
            flow.error = flow.error or error
            flow.cancelled = True
            flow.pending.clear()
            self._maybe_close(flow)
            self._lock.notify_all()

    def _maybe_close(self, flow: Flow) -> None:
        """Under the lock: close the flow once nothing of it is packing or in flight and
        it is done (everything acknowledged) or cancelled."""
        if flow.closed or flow.packing or flow.writes_in_flight:
            return
        done = flow.last_submitted and not flow.pending and flow.unacked == 0
        if not (done or flow.cancelled):
            return
        if flow.cancelled and flow.unacked:
            return  # a SegmentsLanded is still being answered; close after it
        flow.closed = True
        del self._flows[flow.request_id]
        self._post(
            flow,
            FlowClosed(
                flow.request_id,
                self.stage,
                self.num_stages,
                flow.error,
                flow.num_bytes,
                flow.num_ops,
                flow.seconds,
            ),
            None,
        )
        self._finished.append(
            SendResult(flow.request_id, flow.error, flow.num_bytes, flow.num_ops, flow.seconds)
        )

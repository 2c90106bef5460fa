"""Prefill's side of the handoff as a KV connector: every step's new prompt KV leaves for
decode from every pipeline stage, on the stages' own threads (transfer/sender.py).

    scheduler side (stage 0, engine thread)          worker side (every stage process)
    add(rid, landing, notify_url) before the           HandoffWorker: one HandoffSender
      request enters the engine                        over its layers of the paged KV
    build_step_meta: FlowOpen once, then FlowSend  ──▶ start_saves: open / submit / cancel
      of [sent_upto, end) per step (the first           (queues work; never waits)
      starts at token 0: prefix-cache hits are     ◀── get_finished: FlowReport (closed
      sent too), cancels of aborted requests            flows, with bytes, ops, seconds)
    update_from_workers: a request's blocks are released once EVERY stage closed its flow
    request_finished: True while any stage may still read the blocks

The first token leaves the engine as soon as it is sampled; the transfers finish on
their own time (FirstToken is not delayed by them), and each stage tells decode directly.

A request sent before decode answered (PrefillRequest.await_landing, protocol 5) is
registered with `await_landing`: it computes at once; build_step_meta only notes how far
its KV is computed (and in which blocks), and request_finished keeps its blocks. Its
LandingGrant (`grant`, possibly before the request itself: kept as early) makes the next
step open the flow on every stage and send everything computed so far in one FlowSend;
later steps send the rest as usual. A request waiting for its grant with its prompt
computed costs no steps (has_pending is False for it). `cancel` of one that never opened
a flow drops it at once and frees blocks it kept (an abort, no grant in time, a finish
at the first token).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import torch

from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.request import Request, RequestStatus
from protocol.handoff_messages import (
    FlowOpen,
    FlowReport,
    FlowResult,
    FlowSend,
    HandoffMeta,
    without_sends,
)
from protocol.ids import BlockId, RequestId
from protocol.landing_capability import LandingCapabilityError, verify
from protocol.messages import LandingInfo
from transfer import Transport
from transfer.errors import PackLayoutError
from transfer.faults import HandoffFaults
from transfer.sender import HandoffSender, Notify

log = logging.getLogger(__name__)

_meta = msgspec.msgpack.Decoder(HandoffMeta)
_report = msgspec.msgpack.Decoder(FlowReport)


OPENED_KEPT = 65536
"""Request ids a stage remembers having opened (a flow lives seconds; this is hours)."""
ENDED_KEPT = 4096
"""Request ids stage 0 remembers as ended (a late grant for one: "gone")."""
EARLY_KEPT = 4096
"""Grants kept for requests not (yet) registered: the oldest is dropped beyond this."""


@dataclass
class _Handoff:
    """What stage 0 knows of one request's handoff."""

    num_prompt_tokens: int
    open: FlowOpen | None
    """None while the request awaits its landing (await_landing, no grant yet)."""
    sent_upto: int = 0
    opened: bool = False
    finished: bool = False
    """The request left the engine (blocks held while flows are open)."""
    closed: dict[int, FlowResult] = field(default_factory=dict)
    """Stage index (report order) -> its closed flow."""
    computed_upto: int = 0
    """Before its flow opened: prompt tokens whose KV the scheduled steps compute..."""
    block_ids: list[BlockId] = field(default_factory=list)
    """... into these blocks (the request's table at its latest step)."""

    @property
    def flush_due(self) -> bool:
        """Granted with computed KV not sent yet: the next step opens and sends it."""
        return self.open is not None and not self.opened and self.computed_upto > 0


class GrantOutcome(StrEnum):
    """What `HandoffScheduler.grant` did with a LandingGrant."""

    ACCEPTED = "accepted"
    EARLY = "early"
    """The request is not registered (yet): kept until it is, or until it expires."""
    CONFLICT = "conflict"
    """The request has a landing already (inline, or an earlier grant)."""
    GONE = "gone"
    """The request awaited a landing and has ended (aborted, expired, finished)."""


class HandoffScheduler(KVConnectorScheduler):
    """Owns the live handoffs of one prefill instance (stage 0, engine thread only)."""

    def __init__(self, num_stages: int, early_ttl_s: float = 60.0) -> None:
        self.num_stages = num_stages
        self.early_ttl_s = early_ttl_s
        """How long a grant for an unregistered request is kept."""
        self._live: dict[str, _Handoff] = {}
        self._cancels: list[str] = []
        self._released_now: set[RequestId] = set()
        """Requests whose kept blocks no flow will read (dropped while awaiting)."""
        self._early: OrderedDict[str, tuple[float, FlowOpen]] = OrderedDict()
        """Grants that came before their request: id -> (monotonic expiry, the flow)."""
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.on_closed: Callable[[str, list[FlowResult]], None] = lambda _r, _s: None
        """Called when every stage closed a request's flow (results in stage order)."""

    def add(
        self, request_id: str, landing: list[LandingInfo], num_prompt_tokens: int, notify_url: str
    ) -> None:
        """Send this request's prompt KV to `landing` (call before add_request)."""
        self._live[request_id] = _Handoff(
            num_prompt_tokens, FlowOpen(request_id, num_prompt_tokens, list(landing), notify_url)
        )

    def await_landing(self, request_id: str, num_prompt_tokens: int) -> str | None:
        """Register a request whose landing comes later in a grant (call before
        add_request). Returns the notify URL of a grant that came first (applied now)."""
        h = _Handoff(num_prompt_tokens, None)
        self._live[request_id] = h
        early = self._early.pop(request_id, None)
        if early is None or early[0] < time.monotonic():
            return None
        h.open = msgspec.structs.replace(early[1], num_prompt_tokens=num_prompt_tokens)
        return h.open.notify_url

    def grant(self, request_id: str, landing: list[LandingInfo], notify_url: str) -> GrantOutcome:
        """Decode's landing for a request registered with await_landing (or not yet
        registered: kept as early)."""
        h = self._live.get(request_id)
        if h is None:
            if request_id in self._ended:
                return GrantOutcome.GONE
            now = time.monotonic()
            while self._early and (
                len(self._early) >= EARLY_KEPT or next(iter(self._early.values()))[0] < now
            ):
                self._early.popitem(last=False)
            flow = FlowOpen(request_id, 0, list(landing), notify_url)
            self._early[request_id] = (now + self.early_ttl_s, flow)
            return GrantOutcome.EARLY
        if h.open is not None:
            return GrantOutcome.CONFLICT
        h.open = FlowOpen(request_id, h.num_prompt_tokens, list(landing), notify_url)
        return GrantOutcome.ACCEPTED

    def discard(self, request_id: str) -> None:
        """Forget a request that never entered the engine."""
        self._live.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Stop sending (the request ended at its first token, or decode is gone, or it
        never got its landing): a request that opened no flow is dropped at once, and
        blocks it kept are freed with the next update."""
        h = self._live.get(request_id)
        if h is None:
            self._early.pop(request_id, None)
            return
        if h.opened:
            self._cancels.append(request_id)
            return
        del self._live[request_id]
        self._end(request_id)
        if h.finished:
            self._released_now.add(RequestId(request_id))

    def _end(self, request_id: str) -> None:
        """Remember a request that ended (a late grant for it: GONE)."""
        self._ended[request_id] = None
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def awaiting(self, request_id: str) -> bool:
        """Registered with await_landing and not granted."""
        h = self._live.get(request_id)
        return h is not None and h.open is None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        return None

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        opens, sends = [], []
        for rid, g in self._live.items():  # granted since the last step: what is computed
            if g.flush_due:
                assert g.open is not None
                opens.append(g.open)
                g.opened = True
                last = g.computed_upto == g.num_prompt_tokens
                sends.append(FlowSend(rid, 0, g.computed_upto, list(g.block_ids), last))
                g.sent_upto = g.computed_upto
        for kv in computed:
            h = self._live.get(kv.request.request_id)
            if h is None or h.finished:
                continue
            end = min(kv.token_end, h.num_prompt_tokens)
            if h.open is None:  # awaiting its landing: remember, send once granted
                h.computed_upto = end
                h.block_ids = list(kv.block_ids)
                continue
            if end <= h.sent_upto:
                continue
            if not h.opened:
                opens.append(h.open)
                h.opened = True
            last = end == h.num_prompt_tokens
            sends.append(
                FlowSend(kv.request.request_id, h.sent_upto, end, list(kv.block_ids), last)
            )
            h.sent_upto = end
        cancels, self._cancels = self._cancels, []
        if not (opens or sends or cancels):
            return b""
        return msgspec.msgpack.encode(HandoffMeta(opens, sends, cancels))

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """Drops their sends; their flows stay open (a request's blocks are released only
        when every stage closed its flow) until the abort that follows cancels them."""
        if not meta:
            return meta
        return msgspec.msgpack.encode(without_sends(_meta.decode(meta), request_ids))

    def workers_failed(self, meta: bytes, error: str, process: int) -> set[RequestId]:
        """Stage `process` skipped the step's opens, sends and cancels: the requests it
        should have opened or sent fail (decode would miss that stage's layers); every
        flow of theirs, and each cancel of the step, is cancelled (again) next step, so
        each stage closes it (a stage that never opened it answers at once)."""
        if not meta:
            return set()
        m = _meta.decode(meta)
        failing = {RequestId(o.request_id) for o in m.opens}
        failing |= {RequestId(s.request_id) for s in m.sends}
        self._cancels += [rid for rid in {*failing, *m.cancels} if rid in self._live]
        return failing

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        update = ConnectorUpdate(released=self._released_now)
        self._released_now = set()
        for stage, payload in enumerate(reports):
            if not payload:
                continue
            for res in _report.decode(payload).closed:
                h = self._live.get(res.request_id)
                if h is None:
                    continue
                h.closed[stage] = res
                if len(h.closed) == self.num_stages:
                    del self._live[res.request_id]
                    self._end(res.request_id)
                    self.on_closed(res.request_id, [h.closed[s] for s in sorted(h.closed)])
                    # blocks kept at a finish or a preemption are free now (none: no-op)
                    update.released.add(RequestId(res.request_id))
        return update

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        h = self._live.get(request.request_id)
        if h is None:
            return False
        if request.status is RequestStatus.WAITING:
            if not h.opened:  # preempted before any send: its blocks go, it recomputes
                h.computed_upto, h.block_ids = 0, []
            return h.opened  # preempted: keep the blocks the stages may be reading
        aborted = request.status is RequestStatus.FINISHED_ABORTED
        h.finished = True
        if not h.opened:
            if h.computed_upto > 0 and not aborted:
                return True  # kept for its grant (or until cancel drops it)
            del self._live[request.request_id]  # nothing was ever sent
            self._end(request.request_id)
            return False
        if aborted or h.sent_upto < h.num_prompt_tokens:
            self._cancels.append(request.request_id)
        return True

    def has_pending(self) -> bool:
        return bool(self._released_now) or any(h.opened or h.flush_due for h in self._live.values())


class HandoffWorker(KVConnectorWorker):
    """One stage process's sender: its layers of every request to every decode rank."""

    def __init__(
        self,
        transport: Transport,
        staging_bytes: int,
        notify: Notify,
        faults: HandoffFaults | None = None,
        capability_key: bytes | None = None,
    ) -> None:
        self.transport = transport
        self.capability_key = capability_key
        """Landing capabilities are checked with it before a flow opens (None: tests of
        the sender alone)."""
        self.staging_bytes = staging_bytes
        self.notify = notify
        self.faults = faults
        self.sender: HandoffSender | None = None
        self._closed_now: list[FlowResult] = []
        self._opened: OrderedDict[str, None] = OrderedDict()
        """Requests whose FlowOpen this stage ran (the latest OPENED_KEPT): a cancel of
        any other one closes at once (its open was skipped: a failed connector call)."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        self.sender = HandoffSender(
            self.transport,
            self.staging_bytes,
            kv_caches,
            (place.layer_start, place.layer_end),
            stage=place.stage,
            num_stages=place.num_stages,
            notify=self.notify,
            faults=self.faults,
        )

    def start_loads(self, meta: bytes) -> None:
        return None

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """Drops their sends (this stage's forward of them failed); the flows stay open
        until the cancel that follows their failure closes them."""
        if not meta:
            return meta
        return msgspec.msgpack.encode(without_sends(_meta.decode(meta), request_ids))

    def start_saves(self, meta: bytes) -> None:
        if not meta:
            return
        assert self.sender is not None, "register_kv_caches first"
        m = _meta.decode(meta)
        now = time.time()
        for o in m.opens:
            self._opened[o.request_id] = None
            while len(self._opened) > OPENED_KEPT:
                self._opened.popitem(last=False)
            try:
                # this stage writes nothing into a landing decode did not mint for it
                if self.capability_key is not None:
                    for info in o.landing:
                        verify(self.capability_key, o.request_id, info, now)
                self.sender.open(o.request_id, o.landing, o.num_prompt_tokens, o.notify_url)
            except (PackLayoutError, LandingCapabilityError) as e:
                log.warning("handoff of %s cannot start: %s", o.request_id, e)
                self._closed_now.append(FlowResult(o.request_id, str(e), 0, 0, 0.0))
        for s in m.sends:
            self.sender.submit(s.request_id, s.token_start, s.token_end, s.block_table, s.last)
        for rid in m.cancels:
            if rid in self._opened:
                self.sender.cancel(rid)
            else:  # its open never ran here: nothing to stop, the flow is closed
                self._opened[rid] = None
                self._closed_now.append(FlowResult(rid, "no flow on this stage", 0, 0, 0.0))

    def get_finished(self) -> bytes:
        closed, self._closed_now = self._closed_now, []
        if self.sender is not None:
            closed += [
                FlowResult(r.request_id, r.error, r.num_bytes, r.num_ops, r.seconds)
                for r in self.sender.finished()
            ]
        return msgspec.msgpack.encode(FlowReport(closed)) if closed else b""

    def wait(self, timeout_s: float) -> None:
        if self.sender is not None:
            self.sender.wait_finished(timeout_s)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

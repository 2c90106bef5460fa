"""The P->D handoff as a KV connector (engine/kv_connector.py), prefill side.

The handoff of one request is a set of flows, one per (prefill stage, decode rank): each
carries the stage's layers of the rank's tokens and KV heads (transfer/flows.py places
its segments in the rank's landing region). It streams: after every step that computed
tokens of the request, KV [sent_upto, end) goes out as one segment per flow.

    scheduler side (HandoffTable, engine thread of stage 0): build_step_meta plans one
        HandoffCommand per request the step computes, riding the step to every stage
    worker side (StageSender, every stage's process): start_saves sends the stage's
        layers after computing the step and reports the segments; the reports come back
        with the step's result (update_from_workers), so when the first token is out,
        every flow of every stage has landed.

The sends run inside start_saves, so they are done before a later step can reuse the
blocks (request_finished never holds them).

Tokens served from the prefix cache were never computed in a step, so the first segment
starts at token 0, not at the first computed token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.request import Request
from protocol.ids import BlockId
from protocol.messages import HandoffDone, KVSegment, LandingInfo
from protocol.rank_messages import HandoffCommand, HandoffReport
from transfer import HandoffSender, TransferError, send_flows
from transfer.errors import PackLayoutError

log = logging.getLogger(__name__)

_commands = msgspec.msgpack.Decoder(list[HandoffCommand])
_reports = msgspec.msgpack.Decoder(list[HandoffReport])


@dataclass
class Handoff:
    """What has been sent of one request (all flows), and whether sending failed."""

    landing: list[LandingInfo]
    num_prompt_tokens: int
    sent_upto: int = 0
    """Tokens handed to the flows so far (sent, or planned into a step in flight)."""
    segments: list[KVSegment] = field(default_factory=list)
    num_bytes: int = 0
    num_ops: int = 0
    seconds: float = 0.0
    """Gather + write time summed over the flows' segments."""
    error: str | None = None

    def done_event(self, request_id: str) -> HandoffDone:
        return HandoffDone(
            request_id=request_id,
            segments=self.segments,
            num_bytes=self.num_bytes,
            num_ops=self.num_ops,
            seconds=self.seconds,
        )

    def add_report(self, report: HandoffReport) -> None:
        if report.error is not None:
            self.error = self.error or report.error
            return
        self.segments.extend(report.segments)
        self.num_bytes += report.num_bytes
        self.num_ops += report.num_ops
        self.seconds += report.seconds


class StageSender(KVConnectorWorker):
    """The handoff's worker side on one stage: runs the step's HandoffCommands, sending
    this stage's layers to every decode rank."""

    def __init__(self, sender: HandoffSender) -> None:
        self.sender = sender
        self.layers = (0, 0)
        self.stage = 0
        self.kv_caches: list[torch.Tensor] = []
        self._reports: list[HandoffReport] = []

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        self.kv_caches = kv_caches
        self.layers = (place.layer_start, place.layer_end)
        self.stage = place.stage

    def start_loads(self, meta: bytes) -> None:
        return None

    def start_saves(self, meta: bytes) -> None:
        if meta:
            self._reports.extend(self.send(cmd) for cmd in _commands.decode(meta))

    def get_finished(self) -> bytes:
        if not self._reports:
            return b""
        reports, self._reports = self._reports, []
        return msgspec.msgpack.encode(reports)

    def send(self, cmd: HandoffCommand) -> HandoffReport:
        try:
            segments, stats = send_flows(
                self.sender,
                self.kv_caches,
                self.layers,
                cmd.block_table,
                cmd.token_start,
                cmd.token_end,
                cmd.landing,
                cmd.num_prompt_tokens,
            )
        except (TransferError, PackLayoutError) as e:
            log.warning("handoff of %s (stage %d) failed: %s", cmd.request_id, self.stage, e)
            error = f"KV handoff to decode failed (prefill stage {self.stage}): {e}"
            return HandoffReport(cmd.request_id, self.stage, [], 0, 0, 0.0, error)
        return HandoffReport(
            cmd.request_id, self.stage, segments, stats.num_bytes, stats.num_ops, stats.seconds
        )


class HandoffTable(KVConnectorScheduler):
    """Owns the live handoffs of one prefill instance: the handoff's scheduler side.
    Engine thread only."""

    def __init__(self) -> None:
        self._live: dict[str, Handoff] = {}

    def add(self, request_id: str, landing: list[LandingInfo], num_prompt_tokens: int) -> None:
        self._live[request_id] = Handoff(list(landing), num_prompt_tokens)

    def pop(self, request_id: str) -> Handoff | None:
        return self._live.pop(request_id, None)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        return None

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        """Hand KV [sent_upto, end) of each computed prompt to the flows (b"" if none)."""
        planned = []
        for kv in computed:
            cmd = self._plan(kv.request, kv.token_end, kv.block_ids)
            if cmd is not None:
                planned.append(cmd)
        return msgspec.msgpack.encode(planned) if planned else b""

    def _plan(self, req: Request, end: int, table: list[BlockId]) -> HandoffCommand | None:
        h = self._live.get(req.request_id)
        if h is None or h.error is not None:
            return None
        end = min(end, req.num_prompt_tokens)
        if end <= h.sent_upto:
            return None
        cmd = HandoffCommand(
            req.request_id, h.num_prompt_tokens, h.sent_upto, end, list(table), h.landing
        )
        h.sent_upto = end
        return cmd

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        """Every stage's reports of a collected step (stage order)."""
        for payload in reports:
            if not payload:
                continue
            for report in _reports.decode(payload):
                h = self._live.get(report.request_id)
                if h is not None:
                    h.add_report(report)
        return ConnectorUpdate()

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        return False

"""Per-request handoff state on the prefill side, driven from the engine thread.

The handoff of one request is a set of flows, one per (prefill stage, decode rank): each
carries the stage's layers of the rank's tokens and KV heads (transfer/flows.py places
its segments in the rank's landing region). It streams: after every step that computed
tokens of the request, KV [sent_upto, end) goes out as one segment per flow.

    PP = 1     the engine's KV observer sends at once, from this process's cache
    PP >= 2    the KV observer plans a HandoffCommand that rides the step through the
               pipeline; every stage (StageSender) sends its layers after computing the
               step and reports the segments; the reports come back with the step's
               sampled tokens (apply_reports), so when the first token is out, every
               flow of every stage has landed.

Tokens served from the prefix cache were never computed in a step, so the first segment
starts at token 0, not at the first computed token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
import torch

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


class StageSender:
    """Runs the handoff commands of a step on one stage: its layers to every decode rank.
    The stage hook of engine/parallel/pp_runner.py (stage 0 runs it in the driver)."""

    def __init__(self, sender: HandoffSender, layers: tuple[int, int], stage: int) -> None:
        self.sender, self.layers, self.stage = sender, layers, stage

    def send(self, cmd: HandoffCommand, kv_caches: list[torch.Tensor]) -> HandoffReport:
        try:
            segments, stats = send_flows(
                self.sender,
                kv_caches,
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

    def __call__(self, commands: bytes, kv_caches: list[torch.Tensor]) -> bytes:
        reports = [self.send(cmd, kv_caches) for cmd in _commands.decode(commands)]
        return msgspec.msgpack.encode(reports)


class HandoffTable:
    """Owns the live handoffs of one prefill instance. Engine thread only.

    With `local` (PP = 1) the observer sends through it at once; without (PP >= 2) it
    plans commands for the pipeline (take_commands / apply_reports)."""

    def __init__(self, local: StageSender | None, kv_caches: list[torch.Tensor] | None) -> None:
        self.local = local
        self.kv_caches = kv_caches
        self._live: dict[str, Handoff] = {}
        self._planned: list[HandoffCommand] = []

    @classmethod
    def direct(cls, sender: HandoffSender, kv_caches: list[torch.Tensor]) -> HandoffTable:
        """PP = 1: every layer is in `kv_caches`, sent from this process."""
        return cls(StageSender(sender, (0, len(kv_caches)), 0), kv_caches)

    @classmethod
    def pipelined(cls) -> HandoffTable:
        """PP >= 2: the stages send (their StageSenders run as stage hooks)."""
        return cls(None, None)

    def add(self, request_id: str, landing: list[LandingInfo], num_prompt_tokens: int) -> None:
        self._live[request_id] = Handoff(list(landing), num_prompt_tokens)

    def pop(self, request_id: str) -> Handoff | None:
        return self._live.pop(request_id, None)

    def observe(self, req: Request, start: int, end: int, table: list[BlockId]) -> None:
        """The engine's KV observer: hand KV [sent_upto, end) of the prompt to the flows."""
        h = self._live.get(req.request_id)
        if h is None or h.error is not None:
            return
        end = min(end, req.num_prompt_tokens)
        if end <= h.sent_upto:
            return
        cmd = HandoffCommand(
            req.request_id, h.num_prompt_tokens, h.sent_upto, end, list(table), h.landing
        )
        h.sent_upto = end
        if self.local is not None and self.kv_caches is not None:
            h.add_report(self.local.send(cmd, self.kv_caches))
        else:
            self._planned.append(cmd)

    def take_commands(self) -> bytes:
        """The commands planned for the step being issued (b"" if none)."""
        if not self._planned:
            return b""
        planned, self._planned = self._planned, []
        return msgspec.msgpack.encode(planned)

    def apply_reports(self, reports: list[bytes]) -> None:
        """Every stage's reports of a collected step (stage order)."""
        for payload in reports:
            if not payload:
                continue
            for report in _reports.decode(payload):
                h = self._live.get(report.request_id)
                if h is not None:
                    h.add_report(report)

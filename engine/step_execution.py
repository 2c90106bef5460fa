"""The execute part of an engine step (LLMEngine's `StepExecution` base): the model
runs here or on the ranks of a parallel instance, the KV connector's workers start loads
and saves and report, a forward that fails is bisected to the requests that make it fail
(engine/step_isolation.py), a step with nothing to compute only moves the connector's
transfers on, and a pure decode step may launch the next one early (engine/decode_ahead.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnectorScheduler, KVConnectorWorker
from engine.kv_connector_guard import split_reports as split_failures
from engine.model_runner import ModelExecutor, ModelRunner
from engine.outputs import RequestOutput
from engine.request import Request
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.step_isolation import ForwardFailed, find_culprits
from engine.step_trace import StepTrace
from protocol.ids import RequestId

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.02
"""Longest the engine thread waits for a transfer when nothing else can run (it then goes
back to its inbox: new requests and aborts are not held up longer than this)."""


@runtime_checkable
class ConnectorExecutor(Protocol):
    """A runner whose KV connector workers live in several processes (the ranks of a
    TP x DCP instance): it carries the step's connector metadata to every one of them and
    brings their reports back. Engine thread only."""

    def set_kv_worker(self, worker: KVConnectorWorker) -> None:
        """The driver process's own worker side (the other processes build theirs)."""
        ...

    def execute_step(
        self,
        scheduled: list[ScheduledRequest],
        kv: KVCacheManager,
        kv_meta: bytes,
        *,
        load: bool = True,
        probe: bool = False,
    ) -> tuple[torch.Tensor | None, list[bytes]]:
        """Run one step everywhere: (logits as ModelExecutor.execute, one connector
        report per process in rank order). ForwardFailed when every process's forward
        failed (then nothing was saved and the reports wait for the next run). `load`:
        start the connector's loads of kv_meta (False when a failed run did); `probe`:
        the forward only, for bisection (no connector, no reports)."""
        ...

    def poll_kv(self, kv_meta: bytes) -> list[bytes]:
        """A step with nothing to compute: every worker gets `kv_meta` and reports."""
        ...


class StepExecution:
    """What LLMEngine's step() runs between scheduling and sampling. The attributes below
    are the engine's (engine/llm_engine.py)."""

    config: EngineConfig
    runner: ModelExecutor
    kv: KVCacheManager
    kv_worker: KVConnectorWorker
    connector: KVConnectorScheduler
    scheduler: Scheduler
    trace: StepTrace | None
    _requests: dict[RequestId, Request]

    def fail_request(self, req: Request, error: str) -> RequestOutput:
        raise NotImplementedError  # LLMEngine's

    def _decode_ahead(
        self,
        plan: SchedulerOutput,
        scheduled: list[ScheduledRequest],
        culprits: dict[RequestId, str],
    ) -> Callable[[torch.Tensor], None] | None:
        """The sampler's hook that launches the next decode step while this step's tokens
        travel to the host (engine/decode_ahead.py), or None when that step would likely
        be dropped or cannot run ahead: this step is not pure decode, something else
        could join the next step (waiting or loading requests, connector work), or every
        request ends at this token by length."""
        runner = self.runner
        sched = self.scheduler
        if (
            not self.config.decode_ahead
            or not isinstance(runner, ModelRunner)
            or runner.graphs is None
            or culprits
            or plan.kv_meta
            or self.config.faults is not None
            or self.connector.saves_on_eviction()  # allocates only while scheduling
            or sched.waiting
            or sched.loading
            or len(scheduled) != len(sched.running)
            or any(s.num_new_tokens != 1 or not s.samples for s in scheduled)
            or all(
                s.request.num_output_tokens + 1 >= s.request.params.max_tokens for s in scheduled
            )
        ):
            return None
        kv, bs = self.kv, self.config.block_size

        def launch(tokens: torch.Tensor) -> None:
            try:
                for s in scheduled:  # the KV block of the next position, one step early
                    r = s.request
                    short = (r.num_computed_tokens + 1) // bs >= len(kv.block_table(r.request_id))
                    if short and not kv.allocate_slots(r, 2):
                        return
                runner.launch_ahead(scheduled, kv, tokens)
            except Exception:  # the step itself is done: only the head start is lost
                log.exception("launching the next decode step early failed")
                runner.drop_ahead()

        return launch

    def _execute(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, list[bytes], dict[RequestId, str]]:
        """The execute part of a step: the model and the connector's workers; (logits of
        the sampling rows of the requests that did not fail, the workers' reports, the
        requests whose forward failed with why)."""
        if isinstance(self.runner, ConnectorExecutor):
            return self._execute_ranks(self.runner, plan)
        worker = self.kv_worker
        worker.start_loads(plan.kv_meta)
        meta, culprits = plan.kv_meta, {}
        try:
            logits = self._forward(plan.scheduled)
        except Exception as e:
            found = find_culprits(plan.scheduled, self._forward, e)
            culprits = {
                plan.scheduled[i].request.request_id: f"forward failed: {err}"
                for i, err in found.items()
            }
            rest = [s for i, s in enumerate(plan.scheduled) if i not in found]
            logits = self._forward(rest) if rest else None
            meta = self.connector.without_requests(plan.kv_meta, set(culprits))
        worker.start_saves(meta)
        return logits, [worker.get_finished()], culprits

    def _execute_ranks(
        self, runner: ConnectorExecutor, plan: SchedulerOutput
    ) -> tuple[torch.Tensor | None, list[bytes], dict[RequestId, str]]:
        """_execute over a TP x DCP instance: its ranks re-run the bisection in lockstep."""
        try:
            logits, reports = runner.execute_step(plan.scheduled, self.kv, plan.kv_meta)
            return logits, reports, {}
        except ForwardFailed as e:

            def probe(sub: Sequence[ScheduledRequest]) -> object:
                return runner.execute_step(list(sub), self.kv, b"", load=False, probe=True)

            found = find_culprits(plan.scheduled, probe, e)
        culprits = {
            plan.scheduled[i].request.request_id: f"forward failed: {err}"
            for i, err in found.items()
        }
        rest = [s for i, s in enumerate(plan.scheduled) if i not in found]
        meta = self.connector.without_requests(plan.kv_meta, set(culprits))
        logits, reports = runner.execute_step(rest, self.kv, meta, load=False)
        return logits, reports, culprits

    def _forward(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        """This process's model over `scheduled` (safe to repeat: the same KV slots are
        written with the same values)."""
        if self.config.faults is not None:
            self.config.faults.check("forward", (s.request.params for s in scheduled))
        return self.runner.execute(list(scheduled), self.kv)

    def _poll_connector(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Nothing to compute: deliver the step's connector metadata (a load to start) or,
        while transfers are outstanding, wait a little and collect the workers' reports.
        Returns the requests a failed connector call ended."""
        if not plan.kv_meta:
            if not self.connector.has_pending():
                return []
            self.kv_worker.wait(LOAD_POLL_S)
        if isinstance(self.runner, ConnectorExecutor):
            reports = self.runner.poll_kv(plan.kv_meta)
        else:
            self.kv_worker.start_loads(plan.kv_meta)
            self.kv_worker.start_saves(plan.kv_meta)
            reports = [self.kv_worker.get_finished()]
        reports, failing = self.split_reports(reports)
        self.apply_reports(reports)
        return [
            self.fail_request(self._requests[rid], why)
            for rid, why in failing.items()
            if rid in self._requests
        ]

    def apply_reports(self, reports: list[bytes]) -> None:
        """The workers' connector reports of a step (one per process, after
        split_reports) into the scheduler."""
        update = self.connector.update_from_workers(reports)
        if self.trace is not None:
            for rid in update.finished_loads:
                self.trace.request("kv_loaded", rid)
        self.scheduler.update_from_connector(update)

    def split_reports(self, reports: list[bytes]) -> tuple[list[bytes], dict[RequestId, str]]:
        """The workers' own reports, and the live requests that connector calls which
        failed in some process end (engine/kv_connector_guard.py), with why. The
        connector's scheduler side learns of the failures here, before the reports are
        applied. A connector that cannot say which requests a failure concerns fails
        the step (RuntimeError)."""
        inner, failures = split_failures(reports)
        failing: dict[RequestId, str] = {}
        for f in failures:
            why = f"the KV connector's {f.call} failed in process {f.process}: {f.error}"
            try:
                named = self.connector.workers_failed(f.meta, why, f.process)
            except NotImplementedError as e:
                raise RuntimeError(f"{why} ({e})") from None
            for rid in named:
                if rid in self._requests:
                    failing.setdefault(rid, why)
        return inner, failing

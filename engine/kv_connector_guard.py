"""A KV connector worker call that raises on one process fails the requests it concerned,
not the process, the step or the instance.

    every process (rank, stage, or the engine's own): KVConnectorGuard(worker)
      start_loads / without_requests / start_saves raises
          ─▶ caught, logged; the step's saves and sends are skipped on this process
             (what they would save may rest on the failed loads); the process goes on
             with the step (its collectives and ring sends stay in step with the others)
      get_finished ─▶ the worker's report, wrapped with the failed calls' metadata
    the driver (LLMEngine / PipelinedEngine) ─ split_reports ─▶ inner reports +
      failures ─▶ KVConnectorScheduler.workers_failed(meta, error, process): the
      connector's scheduler side, which built that metadata, stops expecting what will
      not come and names the requests that fail now (the others recompute or are not
      concerned); the engine fails those alone (engine/step_isolation.py's culprit path)

The ranks or stages agree because only the driver decides, from the reports it gathers
every step anyway. A report without failures passes unchanged (no cost on the common
path); with failures it is FAILED_MARK + a msgpack GuardedReport (0xc1 is the one byte
msgpack never uses, so no connector report starts with it).

Test-only faults (KVSERVE_KV_FAULT_DIR, as kvpool/faults.py): the file
`<dir>/<call>-p<N>` arms one fault: the next `call` (start_loads or start_saves) with
non-empty metadata in process N (a TP rank or a PP stage index; 0 for a single-process
engine) raises before the worker sees it. Taking the fault removes the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from engine.kv_connector import KVConnectorWorker, WorkerPlace
from engine.step_isolation import describe

log = logging.getLogger(__name__)

FAULT_DIR_ENV = "KVSERVE_KV_FAULT_DIR"
FAILED_MARK = b"\xc1"


class InjectedConnectorFault(RuntimeError):
    """A test-only fault of a connector worker call (KVSERVE_KV_FAULT_DIR)."""


class FailedCall(msgspec.Struct, frozen=True, array_like=True):
    call: str
    meta: bytes
    """The step metadata the call was given (the scheduler side maps it to requests)."""
    error: str


class GuardedReport(msgspec.Struct, frozen=True, array_like=True):
    report: bytes
    failed: list[FailedCall]


_guarded = msgspec.msgpack.Decoder(GuardedReport)


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker call, as the driver sees it: in which process (report index)."""

    process: int
    call: str
    meta: bytes
    error: str


def split_reports(reports: Sequence[bytes]) -> tuple[list[bytes], list[WorkerFailure]]:
    """The workers' own reports (one per process, in order) and the calls that failed."""
    if not any(r[:1] == FAILED_MARK for r in reports):
        return list(reports), []
    inner: list[bytes] = []
    failures: list[WorkerFailure] = []
    for i, r in enumerate(reports):
        if r[:1] != FAILED_MARK:
            inner.append(r)
            continue
        g = _guarded.decode(r[1:])
        inner.append(g.report)
        failures += [WorkerFailure(i, f.call, f.meta, f.error) for f in g.failed]
    return inner, failures


def _take_fault(call: str, process: int) -> bool:
    d = os.environ.get(FAULT_DIR_ENV)
    if not d:
        return False
    try:
        os.remove(os.path.join(d, f"{call}-p{process}"))
    except FileNotFoundError:
        return False
    return True


class KVConnectorGuard(KVConnectorWorker):
    """Wraps one process's connector worker: its calls never raise (see module doc)."""

    def __init__(self, inner: KVConnectorWorker) -> None:
        self.inner = inner
        self.process = 0
        self._failed: list[FailedCall] = []
        self._skip_saves = False
        """A call of this step failed: its saves and sends stay undone here."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        self.process = place.shard.rank if place.shard is not None else place.stage
        self.inner.register_kv_caches(kv_caches, place)

    def start_loads(self, meta: bytes) -> None:
        try:
            self._fault("start_loads", meta)
            self.inner.start_loads(meta)
        except Exception as e:
            self._fail("start_loads", meta, e)

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        try:
            return self.inner.without_requests(meta, request_ids)
        except Exception as e:
            self._fail("without_requests", meta, e)
            return meta

    def start_saves(self, meta: bytes) -> None:
        if self._skip_saves:  # the failed call's metadata names these saves already
            return
        try:
            self._fault("start_saves", meta)
            self.inner.start_saves(meta)
        except Exception as e:
            self._fail("start_saves", meta, e)

    def get_finished(self) -> bytes:
        self._skip_saves = False
        try:
            report = self.inner.get_finished()
        except Exception as e:  # what finished stays with the worker until a later call
            log.exception("process %d: the KV connector's get_finished failed", self.process)
            self._failed.append(FailedCall("get_finished", b"", describe(e)))
            report = b""
        if not self._failed:
            return report
        failed, self._failed = self._failed, []
        return FAILED_MARK + msgspec.msgpack.encode(GuardedReport(report, failed))

    def wait(self, timeout_s: float) -> None:
        self.inner.wait(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def _fault(self, call: str, meta: bytes) -> None:
        if meta and _take_fault(call, self.process):
            raise InjectedConnectorFault(
                f"injected {call} fault in process {self.process} ({FAULT_DIR_ENV}, tests only)"
            )

    def _fail(self, call: str, meta: bytes, e: Exception) -> None:
        log.error("process %d: the KV connector's %s failed: %s", self.process, call, describe(e))
        if not isinstance(e, InjectedConnectorFault):
            log.exception("the failed call")
        self._failed.append(FailedCall(call, meta, describe(e)))
        self._skip_saves = True


def guarded(worker: KVConnectorWorker) -> KVConnectorGuard:
    """`worker` behind a guard (once)."""
    return worker if isinstance(worker, KVConnectorGuard) else KVConnectorGuard(worker)

"""engine/kv_connector_guard.py: a connector worker call that raises is reported with its
step metadata instead of ending the process; the driver splits the reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv_connector import KVConnectorWorker, WorkerPlace
from engine.kv_connector_guard import (
    FAULT_DIR_ENV,
    KVConnectorGuard,
    guarded,
    split_reports,
)


class Recording(KVConnectorWorker):
    """Records its calls; raises where told."""

    def __init__(self, raise_in: str = "") -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.raise_in = raise_in

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        self.calls.append(("register", b""))

    def _call(self, name: str, meta: bytes) -> None:
        self.calls.append((name, meta))
        if name == self.raise_in:
            raise OSError(f"{name} broke")

    def start_loads(self, meta: bytes) -> None:
        self._call("start_loads", meta)

    def start_saves(self, meta: bytes) -> None:
        self._call("start_saves", meta)

    def get_finished(self) -> bytes:
        self._call("get_finished", b"")
        return b"\x92\x01\x02"  # a msgpack report: [1, 2]


def _step(g: KVConnectorGuard, meta: bytes) -> bytes:
    g.start_loads(meta)
    g.start_saves(g.without_requests(meta, set()))
    return g.get_finished()


def test_reports_pass_unchanged_without_failures() -> None:
    inner = Recording()
    g = guarded(inner)
    assert guarded(g) is g
    g.register_kv_caches([], WorkerPlace(0, 4, stage=1, num_stages=2))
    assert g.process == 1
    report = _step(g, b"meta")
    assert report == b"\x92\x01\x02"
    assert split_reports([b"", report]) == ([b"", report], [])
    assert [c for c, _ in inner.calls] == ["register", "start_loads", "start_saves", "get_finished"]


@pytest.mark.parametrize("where", ["start_loads", "start_saves"])
def test_a_failed_call_is_reported_with_its_metadata(where: str) -> None:
    inner = Recording(raise_in=where)
    g = KVConnectorGuard(inner)
    g.register_kv_caches([], WorkerPlace(0, 4, stage=1, num_stages=2))
    report = _step(g, b"step-meta")  # never raises
    called = [c for c, _ in inner.calls]
    # after a failed load the step's saves are skipped (they may rest on it)
    want = ["register", "start_loads", "get_finished"]
    if where == "start_saves":
        want.insert(2, "start_saves")
    assert called == want
    inner_reports, failures = split_reports([b"", report])
    assert inner_reports == [b"", b"\x92\x01\x02"]  # the worker's own report survives
    assert len(failures) == 1
    f = failures[0]
    assert (f.process, f.call, f.meta) == (1, where, b"step-meta")
    assert f.error == f"OSError: {where} broke"
    # the next step runs whole again and reports plainly
    inner.raise_in = ""
    assert _step(g, b"next") == b"\x92\x01\x02"


def test_get_finished_failure_is_reported_and_the_next_call_retries() -> None:
    inner = Recording(raise_in="get_finished")
    g = KVConnectorGuard(inner)
    _, failures = split_reports([_step(g, b"m")])
    assert [(f.call, f.meta) for f in failures] == [("get_finished", b"")]
    inner.raise_in = ""
    assert g.get_finished() == b"\x92\x01\x02"


def test_injected_fault_is_taken_once_by_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    armed = tmp_path / "start_saves-p0"
    armed.touch()
    inner = Recording()
    g = KVConnectorGuard(inner)
    g.register_kv_caches([], WorkerPlace(0, 4))
    g.start_saves(b"")  # empty metadata: nothing to fail, the fault stays armed
    assert armed.exists()
    _, failures = split_reports([_step(g, b"m")])
    assert not armed.exists()
    assert [f.call for f in failures] == ["start_saves"]
    assert "injected start_saves fault in process 0" in failures[0].error
    assert ("start_saves", b"m") not in inner.calls  # refused before the worker saw it
    _, failures = split_reports([_step(g, b"m2")])
    assert failures == []

"""The CPU plan (enginehost/cpu_plan.py): disjoint CPU slices per engine process of a
node, threads sized to them, nothing pinned when processes outnumber CPUs or pinning is
off; and a real process pinned by apply_slot runs on its slice with that many threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from enginehost.cpu_plan import (
    DECODE_THREADS_ENV,
    CpuSlot,
    describe_plan,
    engine_processes,
    plan_slot,
)
from protocol.cluster import load_cluster

REPO = Path(__file__).resolve().parent.parent
LOCAL = load_cluster(REPO / "deploy" / "examples" / "local-pd.yaml")
PARALLEL = load_cluster(REPO / "deploy" / "examples" / "local-parallel.yaml")


def test_prefill_and_decode_split_two_cpus() -> None:
    assert engine_processes(LOCAL, "local") == [("prefill-0", 0), ("decode-0", 0)]
    assert plan_slot(LOCAL, "local", "prefill-0", 0, [0, 1]) == CpuSlot((0,), 1)
    assert plan_slot(LOCAL, "local", "decode-0", 0, [0, 1]) == CpuSlot((1,), 1)


def test_stages_and_ranks_get_disjoint_slices() -> None:
    cpus = list(range(2, 11))  # 9 CPUs of a cpuset, 4 processes: 3 + 2 + 2 + 2
    slots = [
        plan_slot(PARALLEL, "local", name, i, cpus)
        for name, i in (("prefill-0", 0), ("prefill-0", 1), ("decode-0", 0), ("decode-0", 1))
    ]
    assert [s.cpus for s in slots] == [(2, 3, 4), (5, 6), (7, 8), (9, 10)]
    assert [s.threads for s in slots] == [3, 2, 2, 2]


def test_no_pinning_when_outnumbered_or_off() -> None:
    assert plan_slot(PARALLEL, "local", "decode-0", 1, [0, 1]) == CpuSlot(None, 1)
    off = msgspec.structs.replace(LOCAL, cpu_pinning=False)
    assert plan_slot(off, "local", "decode-0", 0, [0, 1, 2, 3]) == CpuSlot(None, 2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_pinned_process_runs_on_its_slice() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import json, os, torch\n"
        "from enginehost.cpu_plan import CpuSlot, apply_slot\n"
        f"apply_slot(CpuSlot(({cpu},), 1))\n"
        "import threading\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)), seen[0], torch.get_num_threads(),"
        " torch.get_num_interop_threads()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[cpu], [cpu], 1, 1]


UNIFIED = load_cluster(REPO / "deploy" / "examples" / "local.yaml")


def test_a_unified_instance_decodes_on_one_thread_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unified default on 2 CPUs: both for steps with prefill rows, one for pure
    decode (the other core left to the router and the event loop); an engine alone on
    its core (P/D) or a 1-CPU unified slot keeps one count; the env override wins."""
    monkeypatch.delenv(DECODE_THREADS_ENV, raising=False)
    assert plan_slot(UNIFIED, "local", "unified-0", 0, [0, 1]) == CpuSlot((0, 1), 2, 1)
    assert plan_slot(UNIFIED, "local", "unified-0", 0, [0, 1, 2, 3]) == CpuSlot((0, 1, 2, 3), 4, 3)
    assert plan_slot(UNIFIED, "local", "unified-0", 0, [5]) == CpuSlot((5,), 1, None)
    assert plan_slot(LOCAL, "local", "decode-0", 0, [0, 1]).decode_threads is None
    assert describe_plan(UNIFIED, "local", [0, 1]) == [
        "unified-0 process 0: CPUs [0, 1], 2 torch thread(s) (1 for decode-only steps)"
    ]
    monkeypatch.setenv(DECODE_THREADS_ENV, "2")
    assert plan_slot(UNIFIED, "local", "unified-0", 0, [0, 1]) == CpuSlot((0, 1), 2, 2)
    assert describe_plan(UNIFIED, "local", [0, 1]) == [
        "unified-0 process 0: CPUs [0, 1], 2 torch thread(s)"
    ]
    monkeypatch.setenv(DECODE_THREADS_ENV, "0")
    with pytest.raises(ValueError, match=DECODE_THREADS_ENV):
        plan_slot(UNIFIED, "local", "unified-0", 0, [0, 1])

"""A short soak (benchmarks/soak.py): a real cluster (`kvserve up`: Mooncake master and
two stores, a prefill, a decode, the router, the real model) under agent sessions for
75 s while the prefill worker is SIGKILLed once; the launcher restarts it.

Asserted: requests completed, some after the fault's window; the killed worker came back
under a new pid; no request failed outside the fault's window; every component's RSS
and the KV / landing / pool occupancy were sampled; the outputs were written; after
`kvserve down` no process, listener, /dev/shm file or state file is left. Memory drift
is measured by the full run (docs/reliability.md), not here: 75 s is inside the
warm-up (the stores' segments are still filling).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import parse_args, run

pytestmark = pytest.mark.slow


def test_short_soak_with_a_killed_prefill_worker(tmp_path: Path) -> None:
    args = parse_args(
        ["--out", str(tmp_path), "--duration", "75", "--faults", "prefill-0@0.35", "--sample", "2"]
    )
    summary = run(args)

    (fault,) = summary["faults"]
    assert fault.component == "prefill-0"
    assert fault.recovered_at_s is not None and fault.new_pid not in (None, fault.old_pid)
    errors = summary["errors"]
    assert errors["errors_outside_fault_windows"] == 0, errors["outside"]
    assert summary["completed_requests"] > 0
    assert summary["completed_after_last_fault"] > 0  # serving resumed

    samples = summary["samples"]
    names = {k for s in samples for k in s.values}
    for component in ("router", "prefill-0", "decode-0", "pool-master", "pool-store-0"):
        assert f"rss_mb:{component}" in names
    assert {"kv_usage:prefill-0", "kv_usage:decode-0", "landing_usage:decode-0"} <= names
    assert "pool_usage" in names
    pids = {s.values["pid:prefill-0"] for s in samples if "pid:prefill-0" in s.values}
    assert pids == {fault.old_pid, fault.new_pid}
    for name in ("soak.json", "samples.csv", "soak.png"):
        assert (tmp_path / name).stat().st_size > 0

    left = summary["leftovers"]
    assert left.clean, left
    assert summary["processes_seen"] >= 6

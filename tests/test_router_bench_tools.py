"""The router benchmarks' own tools: the tokenizer-only model folder the GPU machine's
router loads (benchmarks/tokenizer_folder.py) and the medians of interleaved rounds
(benchmarks/router_table.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.router_table import medians
from benchmarks.tokenizer_folder import write
from modelinfo.info import load_model_info

BUILTIN = "builtin:smollm2-135m-instruct"


def test_tokenizer_folder_loads_as_the_model_it_was_written_from(tmp_path: Path) -> None:
    folder = write(BUILTIN, tmp_path / "smollm2")
    original, copy = load_model_info(BUILTIN), load_model_info(str(folder))
    assert copy.config == original.config
    assert copy.eos_token_ids == original.eos_token_ids
    for text in ("Write one short sentence about caching.", " é🙂\n\n<|im_start|>user\nx", ""):
        assert copy.tokenizer.encode(text) == original.tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert original.chat_template is not None and copy.chat_template is not None
    assert copy.chat_template.render(messages, add_generation_prompt=True) == (
        original.chat_template.render(messages, add_generation_prompt=True)
    )


def _row(system: str, stream: bool, added: float, rps: float) -> dict[str, object]:
    return {
        "system": system,
        "stream": stream,
        "added_seq_p50_ms": added,
        "added_seq_p99_ms": 2 * added,
        "added_load_p50_ms": 3 * added,
        "added_load_p99_ms": 4 * added,
        "router_load": {"req_per_s": rps, "cpu_us_per_req": 100.0},
        "direct_load": {"req_per_s": 2 * rps, "cpu_us_per_req": 0.0},
    }


def test_medians_group_by_system_and_mode() -> None:
    rows = [
        _row("kvserve", False, 1.0, 900.0),
        _row("kvserve", True, 5.0, 500.0),
        _row("kvserve", False, 3.0, 1000.0),
        _row("kvserve", False, 2.0, 2000.0),
        _row("sglang-router", False, 0.5, 3000.0),
    ]
    by_key = {(m["system"], m["stream"]): m for m in medians(rows)}
    assert set(by_key) == {("kvserve", False), ("kvserve", True), ("sglang-router", False)}
    json_row = by_key[("kvserve", False)]
    assert json_row["repeats"] == 3
    assert json_row["added_seq_p50_ms"] == pytest.approx(2.0)
    assert json_row["added_load_p99_ms"] == pytest.approx(8.0)
    assert json_row["router_load"]["req_per_s"] == pytest.approx(1000.0)
    assert json_row["direct_load"]["req_per_s"] == pytest.approx(2000.0)
    assert by_key[("kvserve", True)]["repeats"] == 1


def test_paired_load_pools_every_slice_and_orders_the_paths() -> None:
    """router_overhead's load phase: direct and routed alternate in slices whose samples
    are pooled per path; each path's latency is its own (a 1 ms call against a 6 ms one),
    its CPU columns are the given processes' (none for direct) and the client's."""
    import asyncio
    import os

    from benchmarks.router_overhead import measure_pair

    calls = {"direct": 0, "routed": 0}

    async def direct() -> bytes:
        calls["direct"] += 1
        await asyncio.sleep(0.001)
        return b""

    async def routed() -> bytes:
        calls["routed"] += 1
        await asyncio.sleep(0.006)
        return b""

    d, r = asyncio.run(measure_pair(direct, routed, 4, 0.4, 2, [os.getpid()]))
    assert d["p50_ms"] >= 1.0 and 6.0 <= r["p50_ms"] < 30.0, (d, r)
    assert r["p50_ms"] - d["p50_ms"] > 3.0, (d, r)
    # pooled over both slices: 0.4 s per path at 4 loops, never more than the calls made
    assert 0.2 * 4 / 0.006 <= r["requests"] <= calls["routed"], (r, calls)
    assert 0.2 * 4 / 0.004 <= d["requests"] <= calls["direct"], (d, calls)
    assert r["req_per_s"] > 0.5 * 4 / 0.006 and d["req_per_s"] > r["req_per_s"]
    assert d["cpu_us_per_req_each"] == [] and len(r["cpu_us_per_req_each"]) == 1
    assert d["client_cpu_us_per_req"] > 0 and r["client_cpu_us_per_req"] > 0


def test_paired_load_refuses_no_slices() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.router_overhead", "--slices", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--slices must be at least 1, got 0" in out.stderr

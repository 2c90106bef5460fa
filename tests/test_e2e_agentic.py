"""The agentic benchmark end to end: `kvserve up` of a tiny random Llama with two prefill
instances (or two unified instances) behind the kv_aware router, a few short synthetic
sessions replayed with `kvserve bench agentic`, and the report's reuse checked against
the workers' own counters (kvserve_prompt_tokens_total on every instance's /metrics) and,
replayed one request at a time, against an independent count over the prompts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster_harness import free_ports, start_cluster

pytestmark = pytest.mark.timeout(300)


def _prompt_tokens(metrics_text: str) -> dict[str, float]:
    out = {"gpu": 0.0, "pool": 0.0, "computed": 0.0}
    for m in re.finditer(
        r"^kvserve_prompt_tokens_total\{([^}]*)\} ([0-9.e+]+)$", metrics_text, re.M
    ):
        source = re.search(r'source="(\w+)"', m.group(1))
        if source and source.group(1) in out:
            out[source.group(1)] += float(m.group(2))
    return out


def _unified(port: int, kv: str, name: str = "unified-0") -> dict[str, object]:
    return {
        "name": name,
        "node": "local",
        "port": port,
        "devices": ["cpu"],
        "max_batched_tokens": 512,
        "max_num_seqs": 16,
        "kv_cache_memory": kv,
    }


# CI time: the unified topology's run is `-m slow` (docs/testing.md says what covers it).
@pytest.mark.parametrize("topology", ["pd", pytest.param("unified", marks=pytest.mark.slow)])
def test_tiny_agentic_benchmark_matches_worker_counters(
    tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir: str, topology: str
) -> None:
    t0 = time.monotonic()
    p0, p1 = free_ports(2)
    kind = "prefill" if topology == "pd" else "unified"
    instances = [
        {**_unified(port, "16MiB"), "name": f"{kind}-{i}"} for i, port in enumerate((p0, p1))
    ]
    extra: dict[str, object] = {"prefill": instances}
    if topology == "unified":
        extra = {"prefill": [], "decode": [], "unified": instances}
    cluster = start_cluster(
        tmp_path,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        extra=extra,
        router={"policy": "kv_aware"},
        name="agentic",
    )
    try:
        out = tmp_path / "bench"
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "bench",
                "agentic",
                "--url",
                cluster.router_url,
                "--synthetic",
                "--sessions",
                "3",
                "--turns",
                "4",
                "--max-context",
                "1200",
                "--block-tokens",
                "32",
                "--max-output",
                "8",
                "--time-scale",
                "0.002",
                "--seed",
                "1",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        report = json.loads((out / "report.json").read_text())
        for key in (
            "throughput_tokens_per_s_per_gpu",
            "prompt_tokens",
            "reuse",
            "ceiling",
            "ttft_p50_s",
            "ttft_p90_s",
            "itl_p50_s",
            "errors",
        ):
            assert key in report, key
        assert report["errors"] == 0 and report["requests"] >= 12
        for png in ("ttft.png", "reuse.png", "context.png"):
            assert (out / png).stat().st_size > 1000
        # The report's reuse is the workers' own count of where prompt tokens came from.
        counted = {"gpu": 0.0, "pool": 0.0, "computed": 0.0}
        for port in (p0, p1):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
            for k, v in _prompt_tokens(text).items():
                counted[k] += v
        assert sum(counted.values()) == report["prompt_tokens"]
        assert {k: int(v) for k, v in counted.items()} == report["reuse_tokens"]
        # Shared prefixes were found: sessions share a system prompt and grow turn by turn.
        assert report["reuse"]["gpu"] > 0.3
        assert report["reuse"]["gpu"] + report["reuse"]["pool"] <= report["ceiling"] + 1e-9
    finally:
        down = cluster.down()
        assert down.returncode == 0, down.stderr
    assert time.monotonic() - t0 < 120


def _expected_reuse(prompts: list[list[int]], block_size: int) -> list[int]:
    """Prompt tokens a prefix cache that keeps everything reuses, request by request in
    the order sent, computed from the token ids alone (not from trace hash ids, usage or
    counters): the longest prefix of whole blocks some earlier prompt also had, always
    leaving the last prompt token's block to compute (its logits are sampled)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        full = len(p) // block_size
        matched = 0
        while matched < full and tuple(p[: (matched + 1) * block_size]) in seen:
            matched += 1
        out.append(min(matched, (len(p) - 1) // block_size) * block_size)
        seen.update(tuple(p[: (j + 1) * block_size]) for j in range(full))
    return out


@pytest.mark.parametrize("topology", ["pd", "unified"])
def test_sequential_replay_reuses_exactly_the_ceiling(
    tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir: str, topology: str
) -> None:
    """One prefill (or unified) instance whose cache holds the whole trace, requests one
    at a time: every request's reused tokens (usage) equal an independent count over the
    prompts' token ids, and the report's ceiling (computed from trace hash ids) equals
    their sum."""
    from benchmarks.agentic.replay import TokenBlocks
    from benchmarks.agentic.trace import read_trace

    block_size, vocab = 16, 32_000
    extra: dict[str, object] = {}
    if topology == "unified":
        (port,) = free_ports(1)
        extra = {"prefill": [], "decode": [], "unified": [_unified(port, "64MiB")]}
    cluster = start_cluster(
        tmp_path,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        prefill={"kv_cache_memory": "64MiB"},
        extra=extra,
        name="agentic-seq",
    )
    try:
        out = tmp_path / "bench"
        args = ["--synthetic", "--sessions", "2", "--turns", "4", "--max-context", "1500"]
        args += ["--block-tokens", str(block_size), "--max-output", "4", "--seed", "3"]
        args += ["--time-scale", "0.001", "--max-concurrency", "1", "--vocab-size", str(vocab)]
        args += ["--url", cluster.router_url, "--out", str(out)]
        res = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "bench", "agentic", *args],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert res.returncode == 0, res.stderr[-3000:]
    finally:
        down = cluster.down()
        assert down.returncode == 0, down.stderr
    report = json.loads((out / "report.json").read_text())
    trace = read_trace(out / "trace.jsonl")
    by_key = {(t.session, t.thread): t.requests for t in trace.threads}
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["sent_at_s"])
    assert len(rows) == trace.num_requests and report["errors"] == 0
    blocks = TokenBlocks(block_size, vocab)
    prompts = [blocks.prompt(by_key[(r["session"], r["thread"])][r["index"]]) for r in rows]
    expected = _expected_reuse(prompts, block_size)
    got = [r["gpu_tokens"] + r["pool_tokens"] for r in rows]
    assert got == expected
    assert sum(expected) > 0.3 * report["prompt_tokens"]  # the trace does share prefixes
    # No prompt here is wholly a repeat, so the perfect cache's "all but the last token"
    # and the engine's whole blocks agree: the ceiling is exactly what was reused.
    assert all(e < len(p) - block_size for e, p in zip(expected, prompts, strict=True))
    assert report["reuse_tokens"]["gpu"] + report["reuse_tokens"]["pool"] == sum(expected)
    assert report["ceiling"] * report["prompt_tokens"] == pytest.approx(sum(expected), abs=0.5)

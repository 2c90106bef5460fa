"""The agentic benchmark's report: OUT/report.json, OUT/requests.jsonl and PNG plots.

report.json (every fraction is of prompt tokens; times in seconds):
    throughput_tokens_per_s_per_gpu   (prompt tokens, cached or not, + generated tokens)
                                      / wall time / GPUs (DESIGN §4)
    prompt_tokens, completion_tokens, requests, errors, wall_s, gpus
    reuse {gpu, pool, computed}        from the server's usage (prompt_tokens_details)
    reuse_tokens {gpu, pool, computed}
    ceiling                            reuse a perfect infinite cache would get on the
                                       requests sent, in the order sent
    of_ceiling                         (gpu + pool) / ceiling
    ttft_p50_s, ttft_p90_s, itl_p50_s, itl_p90_s, e2e_p50_s
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.agentic.replay import RequestResult
from benchmarks.agentic.trace import CeilingCounter


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def build_report(
    results: list[RequestResult],
    *,
    block_tokens: int,
    wall_s: float,
    gpus: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ceiling = CeilingCounter(block_tokens)
    for r in results:  # in the order sent: what an infinite cache would have seen
        ceiling.add(r.hash_ids, r.input_length)
    prompt = sum(r.prompt_tokens for r in ok)
    gen = sum(r.completion_tokens for r in ok)
    tokens = {
        "gpu": sum(r.gpu_tokens for r in ok),
        "pool": sum(r.pool_tokens for r in ok),
        "computed": sum(r.computed_tokens for r in ok),
    }
    reuse = {k: (v / prompt if prompt else 0.0) for k, v in tokens.items()}
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    hit = reuse["gpu"] + reuse["pool"]
    report: dict[str, Any] = {
        "throughput_tokens_per_s_per_gpu": (prompt + gen) / wall_s / max(1, gpus)
        if wall_s > 0
        else 0.0,
        "prompt_tokens": prompt,
        "completion_tokens": gen,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "gpus": gpus,
        "reuse": reuse,
        "reuse_tokens": tokens,
        "ceiling": ceiling.ceiling,
        "of_ceiling": hit / ceiling.ceiling if ceiling.ceiling else None,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p90_s": _pct(ttfts, 90),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p90_s": _pct(gaps, 90),
        "e2e_p50_s": _pct(e2es, 50),
        "error_samples": [r.error for r in results if r.error][:5],
    }
    report.update(extra or {})
    return report


def write_outputs(out: Path, report: dict[str, Any], results: list[RequestResult]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for r in results:
            d = asdict(r)
            d.pop("hash_ids")
            f.write(json.dumps(d) + "\n")
    plot(out, results)


def plot(out: Path, results: list[RequestResult]) -> None:
    """ttft.png (CDF), reuse.png (prompt tokens by source over time), context.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if ttfts:
        ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts))
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    if ok:
        t = [r.sent_at_s for r in ok]
        ax.stackplot(
            t,
            [r.gpu_tokens for r in ok],
            [r.pool_tokens for r in ok],
            [r.computed_tokens for r in ok],
            labels=["gpu", "pool", "computed"],
            alpha=0.8,
        )
        ax.legend(loc="upper left")
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("prompt tokens per request")
    ax.set_title("Prompt tokens by source")
    fig.tight_layout()
    fig.savefig(out / "reuse.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for session in dict.fromkeys(r.session for r in results):
        rs = [r for r in results if r.session == session and r.thread == "main"]
        ax.plot([r.sent_at_s for r in rs], [r.input_length for r in rs], marker=".", lw=1)
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("input tokens (main threads)")
    ax.set_title("Context per session")
    fig.tight_layout()
    fig.savefig(out / "context.png", dpi=100)
    plt.close(fig)

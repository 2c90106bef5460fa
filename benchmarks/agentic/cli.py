"""`kvserve bench agentic`: replay an agent trace (or a synthetic one) and write a report.

    kvserve bench agentic --url URL (--trace FILE | --synthetic) [--sessions N] [--turns N]
        [--max-context TOKENS] [--seed N] [--duration S] [--time-scale X] --out DIR

Also `python -m benchmarks.agentic ...` with the same arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rest is imported when the command runs (kvserve's CLI stays light)
    from benchmarks.agentic.trace import Trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL (no /v1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="JSONL agent trace (benchmarks/agentic/trace.py)")
    src.add_argument("--synthetic", action="store_true", help="generate seeded sessions")
    p.add_argument("--sessions", type=int, default=8, help="sessions (synthetic; or first N)")
    p.add_argument("--turns", type=int, default=10, help="main-thread turns per session")
    p.add_argument("--max-context", type=int, default=170_000, help="synthetic scale, tokens")
    p.add_argument("--block-tokens", type=int, default=64, help="synthetic block size")
    p.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=None, help="stop sending after S s")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (1: sequential replay; default: no limit)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies recorded waits")
    p.add_argument("--gpus", type=int, default=1, help="GPUs serving (throughput per GPU)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--vocab-size", type=int, default=32_000, help="token ids stay below it")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", required=True, help="report directory")


def load_trace(args: argparse.Namespace) -> Trace:
    from benchmarks.agentic.synthetic import generate
    from benchmarks.agentic.trace import read_trace

    if args.synthetic:
        return generate(
            sessions=args.sessions,
            turns=args.turns,
            max_context=args.max_context,
            seed=args.seed,
            block_tokens=args.block_tokens,
            max_output_tokens=args.max_output,
        )
    trace = read_trace(args.trace)
    keep = trace.sessions[: args.sessions] if args.sessions else trace.sessions
    trace.threads = [t for t in trace.threads if t.session in set(keep)]
    for t in trace.threads:
        if t.parent is None:
            t.requests = t.requests[: args.turns]
        if args.max_output:
            for r in t.requests:
                r.output_length = min(r.output_length, args.max_output)
    return trace


def run(args: argparse.Namespace) -> int:
    from benchmarks.agentic.replay import Replayer, ReplayOptions
    from benchmarks.agentic.report import build_report, write_outputs
    from benchmarks.agentic.trace import write_trace

    trace = load_trace(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out / "trace.jsonl")
    opts = ReplayOptions(
        url=args.url,
        model=args.model,
        time_scale=args.time_scale,
        duration_s=args.duration,
        vocab_size=args.vocab_size,
        seed=args.seed,
        api_key=args.api_key,
        max_concurrency=args.max_concurrency,
    )
    print(
        f"[bench agentic] {trace.source or args.trace}: {len(trace.sessions)} sessions, "
        f"{len(trace.threads)} threads, {trace.num_requests} requests -> {args.url}",
        file=sys.stderr,
    )
    t0 = time.monotonic()
    results = asyncio.run(Replayer(trace, opts).run())
    wall = time.monotonic() - t0
    report = build_report(
        results,
        block_tokens=trace.block_tokens,
        wall_s=wall,
        gpus=args.gpus,
        extra={"url": args.url, "trace": trace.source or args.trace, "seed": args.seed},
    )
    write_outputs(out, report, results)
    brief = {
        k: report[k] for k in ("requests", "errors", "reuse", "ceiling", "ttft_p50_s", "ttft_p90_s")
    }
    print(json.dumps(brief), file=sys.stderr)
    return 0 if report["errors"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agentic", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))

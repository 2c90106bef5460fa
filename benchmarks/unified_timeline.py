"""Where a unified instance's time to first token and step time go, from its step trace.

    python -m benchmarks.unified_timeline --config deploy/examples/local.yaml --out DIR \
        [--duration 40] [--sessions 2]            (not run in CI: ~1.5 min)
    python -m benchmarks.unified_timeline --analyze DIR      (an earlier run's trace again)

Runs `kvserve up` of a copy of the cluster file whose unified instances record their steps
(KVSERVE_STEP_TRACE, engine/step_trace.py), the seeded agentic replay cpu_peer uses (2
sessions, contexts up to 6K, time scale 0.1) for `--duration` seconds, `kvserve down`, and
prints, per request and in aggregate (p50 / mean / max):

    wait      arrival at the worker -> the first step that schedules it starts (the step in
              flight when it arrived, plus any step that left no room for it)
    prefill   that step's start -> the end of the step that samples its first token, with
              how many steps it took, their new tokens and the decode rows beside them
    emit      the end of that step -> the first token's line leaving the worker
    outside   the client's TTFT p50 - the worker's (router, HTTP, client)

and per step: host time (schedule + building outputs, everything but the forward and the
connector's workers), the gap between steps, and the decode-only step time. The trace's
times are time.monotonic(): wall clock on a shared machine, so read them beside CPU
figures (the engine thread's CPU clock per step is in the trace too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from engine.step_trace import ENV, RequestEvent, StepRecord, read_trace

SERVED = "smollm2-135m-instruct"


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"p50 {statistics.median(xs):7.1f}  mean {statistics.mean(xs):7.1f}  max {max(xs):7.1f}"


def analyze(out: Path) -> dict[str, object]:
    """The breakdown of every trace file under OUT/trace (and OUT/report.json's TTFT)."""
    steps: list[StepRecord] = []
    events: dict[str, dict[str, float]] = {}
    for path in sorted((out / "trace").glob("*.jsonl")):
        for line in read_trace(path):
            if isinstance(line, StepRecord):
                steps.append(line)
            else:
                assert isinstance(line, RequestEvent)
                events.setdefault(line.rid, {})[line.ev] = line.t
    steps.sort(key=lambda s: s.t0)
    by_rid: dict[str, list[StepRecord]] = {}
    for s in steps:
        for row in s.rows:
            by_rid.setdefault(row[0], []).append(s)
    ms = 1e3
    wait, prefill, emit, ttft, num_steps = [], [], [], [], []
    lines = []
    for rid, ev in events.items():
        mine = by_rid.get(rid)
        if "arrival" not in ev or "first_token" not in ev or not mine:
            continue
        first = next((s for s in mine if any(r[0] == rid and r[3] for r in s.rows)), None)
        if first is None:
            continue
        taken = [s for s in mine if s.t0 <= first.t0]
        wait.append((taken[0].t0 - ev["arrival"]) * ms)
        prefill.append((first.end - taken[0].t0) * ms)
        emit.append((ev["first_token"] - first.end) * ms)
        ttft.append((ev["first_token"] - ev["arrival"]) * ms)
        num_steps.append(len(taken))
        shape = [
            (next(r[1] for r in s.rows if r[0] == rid), len(s.rows) - 1, round((s.end - s.t0) * ms))
            for s in taken
        ]
        lines.append(f"  {rid[-8:]}  wait {wait[-1]:6.1f}  steps (new, others, ms) {shape}")
    host = [((s.sched - s.t0) + (s.end - s.exec)) * ms for s in steps]
    gaps = [(b.t0 - a.end) * ms for a, b in itertools.pairwise(steps)]
    gaps = [g for g in gaps if g < 50]  # idle periods are not overhead
    decode = [(s.end - s.t0) * ms for s in steps if all(r[1] == 1 for r in s.rows)]
    result: dict[str, object] = {
        "requests": len(ttft),
        "steps": len(steps),
        "worker_ttft_ms_p50": statistics.median(ttft) if ttft else None,
        "wait_ms_p50": statistics.median(wait) if wait else None,
        "prefill_ms_p50": statistics.median(prefill) if prefill else None,
        "emit_ms_p50": statistics.median(emit) if emit else None,
        "host_ms_per_step_p50": statistics.median(host) if host else None,
        "decode_step_ms_p50": statistics.median(decode) if decode else None,
    }
    report = out / "report.json"
    if report.exists() and ttft:
        client = json.loads(report.read_text())["ttft_p50_s"] * ms
        result["client_ttft_ms_p50"] = client
        result["outside_ms_p50"] = client - statistics.median(ttft)
    print("\n".join(lines))
    print(f"requests {len(ttft)}, steps {len(steps)} ({len(decode)} decode-only); ms:")
    print(f"  worker TTFT   {_stats(ttft)}")
    print(f"  wait          {_stats(wait)}")
    print(f"  prefill       {_stats(prefill)}   steps {_stats([float(n) for n in num_steps])}")
    print(f"  emit          {_stats(emit)}")
    print(f"  host / step   {_stats(host)}")
    print(f"  gap / step    {_stats(gaps)}")
    print(f"  decode step   {_stats(decode)}")
    if "outside_ms_p50" in result:
        print(
            f"  client TTFT p50 {result['client_ttft_ms_p50']:.1f}: outside the worker "
            f"{result['outside_ms_p50']:.1f}"
        )
    (out / "timeline.json").write_text(json.dumps(result, indent=1))
    return result


def run(args: argparse.Namespace) -> Path:
    out = Path(args.out).resolve()
    trace = out / "trace"
    trace.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(args.config).read_text())
    for inst in cfg.get("unified", []):
        inst["env"] = {**inst.get("env", {}), ENV: str(trace)}
    config = out / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    kv = [sys.executable, "-m", "kvserve.cli"]
    state = out / "state"
    subprocess.run(
        [*kv, "up", "-c", str(config), "--detach", "--state-dir", str(state)],
        check=True,
        timeout=600,
    )
    try:
        from protocol.cluster import load_cluster

        url = load_cluster(str(config)).router_url
        bench = [*kv, "bench", "agentic", "--url", url, "--synthetic"]
        bench += ["--sessions", str(args.sessions), "--turns", "20", "--max-context", "6000"]
        bench += ["--seed", "0", "--duration", str(args.duration), "--time-scale", "0.1"]
        bench += ["--vocab-size", "49152", "--model", SERVED, "--out", str(out)]
        subprocess.run(bench, check=False, timeout=args.duration + 600)
    finally:
        subprocess.run(
            [*kv, "down", "-c", str(config), "--state-dir", str(state)], check=False, timeout=120
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="deploy/examples/local.yaml")
    p.add_argument("--out", help="results directory (a run)")
    p.add_argument("--analyze", help="an earlier run's results directory (no run)")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--sessions", type=int, default=2)
    args = p.parse_args(argv)
    if args.analyze:
        analyze(Path(args.analyze))
        return 0
    if not args.out:
        p.error("--out or --analyze is required")
    analyze(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a traced cluster's time goes, window by window and instance by instance.

    python -m benchmarks.serving_timeline TRACE_DIR [--requests OUT/agentic/requests.jsonl]
        [--window 5] [--fine-s 60] [--coarse 30] [--cold 32] [--json PATH]

Reads every instance's step trace under TRACE_DIR (engine/step_trace.py: <instance>-<pid>
.jsonl or .jsonl.gz, written with KVSERVE_STEP_TRACE in the instance's `env:`) and prints,
from the first request's arrival (t = 0), per window (`--window` s up to `--fine-s`, then
`--coarse` s) and per instance:

    steps        steps that started in the window
    busy         the window's time inside a step (steps overlapping it, clipped) / its length
    step ms      mean step duration, and its split: sched (schedule()), exec (the forward
                 and the connector's workers), out (sampling and building outputs)
    gap ms       mean time from the previous step's end to the step's start
    tok/s        tokens computed (rows' new tokens) / the window's length
    tok/step, rows/step, dec/step   per step: tokens, scheduled rows, rows past their prompt
    pre          requests preempted; queued: mean requests left waiting or loading KV
    cpu/wall     the engine thread's CPU time / wall time, inside steps and in the gaps.
                 Wall far above CPU: the thread waited off-CPU (the GIL, a lock, a sleep).
                 A wait on the GPU counts as CPU under CUDA's default spin-wait, so a busy
                 step near 1.0 is a thread computing or waiting on the device.
    arr, 1st     requests arriving, requests whose first token left the instance

A step belongs to the window its start falls in (its busy time is clipped to each window
it overlaps). With `--requests` (the agentic benchmark's requests.jsonl; its times count
from the replay's start, aligned here on the first request) each window also gets the
client's requests sent, their TTFT p50 and errors.

Cold start: the window from the first arrival to the first token of the last of the
first `--cold` requests (by arrival), summarised the same way, with those requests' time
to first token at the worker (min / p50 / max) and the tokens computed for them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.step_trace import RequestEvent, StepRecord, read_trace


@dataclass
class InstanceTrace:
    """One instance's steps (by start) and its requests' milestones: rid -> ev -> t."""

    steps: list[StepRecord] = field(default_factory=list)
    events: dict[str, dict[str, float]] = field(default_factory=dict)


def load(trace_dir: Path) -> dict[str, InstanceTrace]:
    """Every instance's trace under `trace_dir` (a restarted instance's files merged)."""
    out: dict[str, InstanceTrace] = {}
    for path in sorted(trace_dir.iterdir()):
        name = path.name.removesuffix(".gz")
        if not name.endswith(".jsonl"):
            continue
        instance = name.removesuffix(".jsonl").rsplit("-", 1)[0]
        it = out.setdefault(instance, InstanceTrace())
        for line in read_trace(path):
            if isinstance(line, StepRecord):
                it.steps.append(line)
            else:
                assert isinstance(line, RequestEvent)
                it.events.setdefault(line.rid, {}).setdefault(line.ev, line.t)
    for it in out.values():
        it.steps.sort(key=lambda s: s.t0)
    return out


@dataclass
class WindowStats:
    """One instance over [lo, hi) (seconds from the origin); means over its steps."""

    lo: float
    hi: float
    steps: int = 0
    busy: float = 0.0
    step_ms: float = 0.0
    sched_ms: float = 0.0
    exec_ms: float = 0.0
    out_ms: float = 0.0
    gap_ms: float = 0.0
    tok_s: float = 0.0
    tok_step: float = 0.0
    rows_step: float = 0.0
    dec_step: float = 0.0
    pre: int = 0
    queued: float = 0.0
    cpu_step: float | None = None
    """Engine-thread CPU / wall inside the window's steps (None: no CPU clock recorded)."""
    cpu_gap: float | None = None
    """The same in the gaps before them."""
    arrivals: int = 0
    first_tokens: int = 0


def window(it: InstanceTrace, origin: float, lo: float, hi: float) -> WindowStats:
    """`it`'s figures over [origin + lo, origin + hi)."""
    a, b = origin + lo, origin + hi
    w = WindowStats(lo, hi)
    w.arrivals = sum(a <= ev["arrival"] < b for ev in it.events.values() if "arrival" in ev)
    w.first_tokens = sum(
        a <= ev["first_token"] < b for ev in it.events.values() if "first_token" in ev
    )
    w.busy = sum(max(0.0, min(s.end, b) - max(s.t0, a)) for s in it.steps) / (b - a)
    mine = [(i, s) for i, s in enumerate(it.steps) if a <= s.t0 < b]
    if not mine:
        return w
    n = w.steps = len(mine)
    steps = [s for _, s in mine]
    ms = 1e3 / n
    w.step_ms = sum(s.end - s.t0 for s in steps) * ms
    w.sched_ms = sum(s.sched - s.t0 for s in steps) * ms
    w.exec_ms = sum(s.exec - s.sched for s in steps) * ms
    w.out_ms = sum(s.end - s.exec for s in steps) * ms
    tokens = sum(r[1] for s in steps for r in s.rows)
    w.tok_s = tokens / (b - a)
    w.tok_step = tokens / n
    w.rows_step = sum(len(s.rows) for s in steps) / n
    w.dec_step = sum(s.past_prompt for s in steps) / n
    w.pre = sum(s.pre for s in steps)
    w.queued = sum(s.queued for s in steps) / n
    after = [(it.steps[i - 1], s) for i, s in mine if i > 0]
    if after:
        w.gap_ms = sum(s.t0 - p.end for p, s in after) / len(after) * 1e3
    if all(s.cpu0 >= 0 for s in steps):
        w.cpu_step = sum(s.cpu - s.cpu0 for s in steps) / max(
            1e-9, sum(s.end - s.t0 for s in steps)
        )
        timed = [(p, s) for p, s in after if p.cpu0 >= 0]
        gap_wall = sum(s.t0 - p.end for p, s in timed)
        if timed and gap_wall > 0:
            w.cpu_gap = sum(s.cpu0 - p.cpu for p, s in timed) / gap_wall
    return w


def origin_of(traces: dict[str, InstanceTrace]) -> float:
    """t = 0: the first request's arrival at any instance (the first step's start if none)."""
    times = [
        ev["arrival"] for it in traces.values() for ev in it.events.values() if "arrival" in ev
    ]
    return min(times) if times else min(it.steps[0].t0 for it in traces.values() if it.steps)


def edges(span_s: float, window_s: float, fine_s: float, coarse_s: float) -> list[float]:
    """Window bounds over [0, span_s]: `window_s` wide up to `fine_s`, then `coarse_s`."""
    out = [0.0]
    while out[-1] < span_s:
        out.append(out[-1] + (window_s if out[-1] < fine_s - 1e-9 else coarse_s))
    return out


@dataclass
class ColdStart:
    """The first `num_requests` requests (by arrival) until the last one's first token."""

    num_requests: int
    end_s: float
    ttft_s: list[float]
    """min, p50, max of their first token's time after their arrival (the first instance
    each reached and the first it left; in P/D: decode's /decode -> prefill's FirstToken)."""
    computed_tokens: dict[str, int]
    """Per instance: the tokens computed for them."""
    instances: dict[str, WindowStats]


def cold_start(traces: dict[str, InstanceTrace], origin: float, num: int) -> ColdStart | None:
    seen: dict[str, dict[str, float]] = {}
    for it in traces.values():
        for rid, ev in it.events.items():
            mine = seen.setdefault(rid, {})
            for k in ("arrival", "first_token"):
                if k in ev:
                    mine[k] = min(mine.get(k, ev[k]), ev[k])
    first = sorted((ev for ev in seen.items() if "arrival" in ev[1]), key=lambda x: x[1]["arrival"])
    first = first[:num]
    if not first or any("first_token" not in ev for _, ev in first):
        return None
    ttft = sorted(ev["first_token"] - ev["arrival"] for _, ev in first)
    end = max(ev["first_token"] for _, ev in first) - origin
    rids = {rid for rid, _ in first}
    computed = {
        name: sum(r[1] for s in it.steps for r in s.rows if r[0] in rids)
        for name, it in traces.items()
    }
    # up to and with the last first token (a window's end is open)
    stats = {name: window(it, origin, 0.0, end + 1e-6) for name, it in traces.items()}
    return ColdStart(len(first), end, [ttft[0], statistics.median(ttft), ttft[-1]], computed, stats)


def client_windows(requests: Path, bounds: list[float]) -> list[dict[str, float | int | None]]:
    """Per window: the client's requests sent in it, their TTFT p50 (s) and errors."""
    rows = [json.loads(line) for line in requests.read_text().splitlines() if line.strip()]
    t0 = min((r["sent_at_s"] for r in rows), default=0.0)
    out: list[dict[str, float | int | None]] = []
    for lo, hi in itertools.pairwise(bounds):
        mine = [r for r in rows if lo <= r["sent_at_s"] - t0 < hi]
        ttft = [r["ttft_s"] for r in mine if r.get("ttft_s") is not None]
        out.append(
            {
                "sent": len(mine),
                "ttft_p50_s": statistics.median(ttft) if ttft else None,
                "errors": sum(r.get("error") is not None for r in mine),
            }
        )
    return out


HEAD = (
    f"{'window s':>11} {'instance':<12} {'steps':>5} {'busy':>5} {'step ms':>8} "
    f"{'sched':>6} {'exec':>7} {'out':>6} {'gap ms':>7} {'tok/s':>8} {'tok/st':>7} "
    f"{'rows':>5} {'dec':>5} {'pre':>3} {'queued':>6} {'cpu st':>6} {'cpu gap':>7} "
    f"{'arr':>4} {'1st':>4}"
)


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def line(name: str, w: WindowStats) -> str:
    return (
        f"{w.lo:5.1f}-{w.hi:<5.1f} {name:<12} {w.steps:5d} {w.busy:5.2f} {w.step_ms:8.1f} "
        f"{w.sched_ms:6.1f} {w.exec_ms:7.1f} {w.out_ms:6.1f} {w.gap_ms:7.1f} {w.tok_s:8.0f} "
        f"{w.tok_step:7.0f} {w.rows_step:5.1f} {w.dec_step:5.1f} {w.pre:3d} {w.queued:6.1f} "
        f"{_frac(w.cpu_step):>6} {_frac(w.cpu_gap):>7} {w.arrivals:4d} {w.first_tokens:4d}"
    )


def report(
    trace_dir: Path,
    requests: Path | None = None,
    *,
    window_s: float = 5.0,
    fine_s: float = 60.0,
    coarse_s: float = 30.0,
    cold: int = 32,
) -> dict[str, object]:
    """Print the timeline and the cold start of `trace_dir`; returns them as a dict."""
    if not trace_dir.is_dir():
        raise SystemExit(f"{trace_dir} is not a directory of step traces")
    traces = load(trace_dir)
    if not any(it.steps for it in traces.values()):
        raise SystemExit(f"no steps traced under {trace_dir}")
    origin = origin_of(traces)
    span = max(it.steps[-1].end for it in traces.values() if it.steps) - origin
    bounds = edges(span, window_s, fine_s, coarse_s)
    table = {
        name: [window(it, origin, lo, hi) for lo, hi in itertools.pairwise(bounds)]
        for name, it in sorted(traces.items())
    }
    clients = client_windows(requests, bounds) if requests is not None else None
    print(HEAD)
    for i in range(len(bounds) - 1):
        for name, ws in table.items():
            print(line(name, ws[i]))
        if clients is not None:
            c = clients[i]
            p50 = "-" if c["ttft_p50_s"] is None else f"{c['ttft_p50_s']:.2f} s"
            print(f"{'':11} {'client':<12} sent {c['sent']}, TTFT p50 {p50}, errors {c['errors']}")
    cs = cold_start(traces, origin, cold)
    if cs is not None:
        lo, p50, hi = cs.ttft_s
        print(
            f"cold start: the first {cs.num_requests} requests' first tokens by "
            f"{cs.end_s:.1f} s; TTFT at the worker {lo:.2f} / {p50:.2f} / {hi:.2f} s "
            "(min / p50 / max)"
        )
        for name, w in cs.instances.items():
            print(line(name, w) + f"   for them: {cs.computed_tokens[name]} tokens")
    return {
        "windows": {name: [asdict(w) for w in ws] for name, ws in table.items()},
        "client": clients,
        "cold_start": asdict(cs) if cs is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--requests", type=Path, help="the agentic benchmark's requests.jsonl")
    p.add_argument("--window", type=float, default=5.0, help="window length (s)")
    p.add_argument("--fine-s", type=float, default=60.0, help="windows of --window up to here")
    p.add_argument("--coarse", type=float, default=30.0, help="window length after --fine-s")
    p.add_argument("--cold", type=int, default=32, help="requests of the cold start")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.window <= 0 or args.coarse <= 0:
        p.error("--window and --coarse must be positive")
    result = report(
        args.trace_dir,
        args.requests,
        window_s=args.window,
        fine_s=args.fine_s,
        coarse_s=args.coarse,
        cold=args.cold,
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The soak run's figures: memory drift after warm-up, errors in and out of fault windows,
and OUT/samples.csv, OUT/soak.json, OUT/soak.png.

Drift is measured per process incarnation (a killed worker's successor is another
process): the median RSS of the window right after the incarnation's warm-up against the
median of its last window. An incarnation too short to hold both windows is listed
without a drift. The cluster total is the sum over components at each sample.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.agentic.replay import RequestResult
from benchmarks.soak_watch import Sample


@dataclass
class FaultRecord:
    """One injected fault: what was killed, when, and when it served again."""

    name: str
    component: str
    old_pid: int
    killed_at_s: float
    recovered_at_s: float | None
    """Its successor answered /health (None: never, within the wait)."""
    window_end_s: float
    """recovered_at_s + grace: requests overlapping [killed_at_s, window_end_s] count as
    in the fault's window."""
    new_pid: int | None = None


@dataclass
class Drift:
    component: str
    pid: int
    start_s: float
    end_s: float
    baseline_mb: float | None
    final_mb: float | None
    drift: float | None
    """(final - baseline) / baseline; None when the incarnation was too short."""


def _median_in(points: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    vals = [v for t, v in points if lo <= t <= hi]
    return statistics.median(vals) if vals else None


def drifts(samples: list[Sample], warmup_s: float, window_s: float) -> list[Drift]:
    """Drift of every incarnation of every component (and of the total, pid 0)."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    totals: list[tuple[float, float]] = []
    for s in samples:
        total = 0.0
        for key, v in s.values.items():
            if key.startswith("rss_mb:"):
                name = key.split(":", 1)[1]
                pid = int(s.values.get(f"pid:{name}", 0))
                series.setdefault((name, pid), []).append((s.t_s, v))
                total += v
        totals.append((s.t_s, total))
    series[("total", 0)] = totals
    out = []
    for (name, pid), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        start, end = pts[0][0], pts[-1][0]
        lo = (start if start > 1.0 else 0.0) + warmup_s
        base = final = drift = None
        if end - lo >= 2 * window_s:
            base = _median_in(pts, lo, lo + window_s)
            final = _median_in(pts, end - window_s, end)
            if base and final is not None:
                drift = (final - base) / base
        out.append(Drift(name, pid, start, end, base, final, drift))
    return out


def classify_errors(
    results: list[RequestResult], origin_s: float, faults: list[FaultRecord]
) -> dict[str, Any]:
    """Errors of requests overlapping a fault window vs the others (`origin_s`: the replay's
    start in the soak's clock)."""
    inside: list[dict[str, Any]] = []
    outside: list[dict[str, Any]] = []
    for r in results:
        if r.error is None:
            continue
        a = origin_s + r.sent_at_s
        b = origin_s + (r.ended_at_s if r.ended_at_s is not None else r.sent_at_s)
        hit = any(a <= f.window_end_s and b >= f.killed_at_s for f in faults)
        (inside if hit else outside).append(
            {"sent_at_s": round(a, 2), "ended_at_s": round(b, 2), "error": r.error[:200]}
        )
    return {
        "requests": len(results),
        "errors_in_fault_windows": len(inside),
        "errors_outside_fault_windows": len(outside),
        "outside": outside,
        "inside": inside,
    }


def write_csv(path: Path, samples: list[Sample]) -> None:
    keys = sorted({k for s in samples for k in s.values})
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", *keys])
        for s in samples:
            w.writerow([f"{s.t_s:.2f}", *(s.values.get(k, "") for k in keys)])


def write_json(path: Path, summary: dict[str, Any]) -> None:
    def default(o: object) -> object:
        return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)  # type: ignore[call-overload]

    path.write_text(json.dumps(summary, indent=2, default=default))


def plot(path: Path, samples: list[Sample], faults: list[FaultRecord], warmup_s: float) -> None:
    """RSS per component (top) and occupancy (bottom) over time; fault windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    keys = sorted({k for s in samples for k in s.values})
    for k in keys:
        if k.startswith("pid:"):
            continue
        ax = top if k.startswith("rss_mb:") else bottom
        pid_key = "pid:" + k.split(":", 1)[-1]
        segments: dict[float, list[tuple[float, float]]] = {}  # one line per incarnation
        for s in samples:
            if k in s.values:
                segments.setdefault(s.values.get(pid_key, 0.0), []).append((s.t_s, s.values[k]))
        color = None
        for i, pts in enumerate(segments.values()):
            xs, ys = zip(*pts, strict=True)
            label = (k.split(":", 1)[-1] if ax is top else k) if i == 0 else None
            (line,) = ax.plot(xs, ys, ".-", ms=2, lw=1, label=label, color=color)
            color = line.get_color()
    for ax in (top, bottom):
        ax.axvspan(0, warmup_s, color="0.9", label="warm-up" if ax is top else None)
        for f in faults:
            ax.axvspan(f.killed_at_s, f.window_end_s, color="tab:red", alpha=0.12)
            ax.axvline(f.killed_at_s, color="tab:red", lw=0.8)
            if ax is top:
                ax.text(
                    f.killed_at_s,
                    1.0,
                    f" kill {f.component}",
                    rotation=90,
                    va="top",
                    fontsize=7,
                    color="tab:red",
                    transform=ax.get_xaxis_transform(),
                )
        ax.grid(alpha=0.3)
    top.set_ylabel("RSS of the process tree (MiB)")
    top.set_yscale("log")
    top.legend(fontsize=7, ncol=3, loc="lower right")
    bottom.set_ylabel("occupancy (fraction)")
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_xlabel("seconds since the replay started (red: fault until served again + grace)")
    bottom.legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle("kvserve soak: memory and KV / landing / pool occupancy under faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

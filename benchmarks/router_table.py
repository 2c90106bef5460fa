"""The results of benchmarks/router_overhead.py: one row per router, mode and round as a
Markdown table row, and the medians of interleaved rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def medians(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and mode, the median over its repeats of each table figure."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["stream"]), []).append(row)
    out = []
    for (system, stream), group in groups.items():
        med = {"system": system, "stream": stream, "repeats": len(group)}
        for key in (
            "added_seq_p50_ms",
            "added_seq_p99_ms",
            "added_load_p50_ms",
            "added_load_p99_ms",
        ):
            med[key] = statistics.median(r[key] for r in group)
        for phase in ("router_load", "direct_load"):
            med[phase] = {
                k: statistics.median(r[phase][k] for r in group)
                for k in ("req_per_s", "cpu_us_per_req")
            }
        out.append(med)
    return out


TABLE_HEAD = (
    "| router | mode | added p50 / p99, 1 conn (ms) | added p50 / p99 at 64 (ms) "
    "| req/s at 64 | direct req/s at 64 | router CPU µs/req at 64 |"
    "\n|---|---|---:|---:|---:|---:|---:|"
)


def table_row(row: dict[str, Any]) -> str:
    return (
        f"| {row['system']} | {'stream' if row['stream'] else 'JSON'} "
        f"| {row['added_seq_p50_ms']:+.2f} / {row['added_seq_p99_ms']:+.2f} "
        f"| {row['added_load_p50_ms']:+.2f} / {row['added_load_p99_ms']:+.2f} "
        f"| {row['router_load']['req_per_s']:,.0f} | {row['direct_load']['req_per_s']:,.0f} "
        f"| {row['router_load']['cpu_us_per_req']:,.0f} |"
    )

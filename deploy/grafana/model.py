"""The dashboard model (queries, panels, dashboards) and PromQL helpers shared by
panels.py (what the dashboards show) and build_dashboards.py (their Grafana JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

DS = {"type": "prometheus", "uid": "${datasource}"}
C = 'cluster=~"$cluster"'
RI = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    stack: bool = False


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


# -- PromQL helpers ---------------------------------------------------------------------


def sel(metric: str, *matchers: str) -> str:
    """`metric{cluster=~"$cluster", matchers...}`."""
    return f"{metric}{{{', '.join((C, *matchers))}}}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({sel(metric, *matchers)}[{RI}])"


def sum_rate(metric: str, *matchers: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({rate(metric, *matchers)})"


def quantiles(histogram: str, by: str = "", what: str = "") -> tuple[Query, ...]:
    """p50 and p90 of a histogram (`histogram` without `_bucket`), grouped by `by`."""
    group = f"le, {by}" if by else "le"
    prefix = (what + " ") if what else ""
    suffix = "".join(f" {{{{{label.strip()}}}}}" for label in by.split(",") if label.strip())
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket')}))",
            f"{prefix}p{round(q * 100)}{suffix}",
        )
        for q in (0.5, 0.9)
    )


# -- the dashboards ---------------------------------------------------------------------

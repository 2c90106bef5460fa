"""router/lean_counter.py exposes what prometheus_client's Counter and Gauge expose."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from router.lean_counter import LeanCounter, LeanGauge


def _exposition(registry: CollectorRegistry) -> list[str]:
    """Lines, with the `_created` timestamps (creation times differ) replaced."""
    text = generate_latest(registry).decode()
    return re.sub(r"(_created(\{[^}]*\})?) [0-9.e+]+", r"\1 T", text).splitlines()


def test_labelled_counter_same_exposition() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    lean = LeanCounter("x_requests", "X", ("endpoint", "status"), ours)
    reference = Counter("x_requests", "X", ["endpoint", "status"], registry=theirs)
    for labels, amount in (
        (("chat", "200"), 1),
        (("completion", "400"), 2.5),
        (("chat", "200"), 3),
    ):
        lean.labels(*labels).inc(amount)
        reference.labels(*labels).inc(amount)
    lean.labels("completion", "499")  # created at 0, as prometheus_client's labels() does
    reference.labels("completion", "499")
    expected = _exposition(theirs)
    assert _exposition(ours) == expected
    assert 'x_requests_total{endpoint="chat",status="200"} 4.0' in expected
    assert 'x_requests_total{endpoint="completion",status="499"} 0.0' in expected
    assert any(line.startswith("x_requests_created{") for line in expected)


def test_unlabelled_counter_and_gauges_same_exposition() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c, rc = LeanCounter("x_tokens", "T", (), ours), Counter("x_tokens", "T", registry=theirs)
    g, rg = LeanGauge("x_in_flight", "F", (), ours), Gauge("x_in_flight", "F", registry=theirs)
    lg = LeanGauge("x_reserved", "R", ("instance",), ours)
    rlg = Gauge("x_reserved", "R", ["instance"], registry=theirs)
    c.inc(7)
    rc.inc(7)
    for _ in range(3):
        g.inc()
        rg.inc()
    g.dec()
    rg.dec()
    lg.labels("d0").set(120)
    rlg.labels("d0").set(120)
    lg.labels("d1").set(5)
    rlg.labels("d1").set(5)
    lg.labels("d0").set(0)
    rlg.labels("d0").set(0)
    expected = _exposition(theirs)
    assert _exposition(ours) == expected
    assert "x_in_flight 2.0" in expected and 'x_reserved{instance="d1"} 5.0' in expected


def test_wrong_label_count_is_refused() -> None:
    lean = LeanCounter("x_routed", "R", ("role", "instance"), CollectorRegistry())
    with pytest.raises(ValueError, match="expected labels"):
        lean.labels("decode")

"""router/lean_histogram.py exposes what prometheus_client's Histogram exposes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.lean_histogram import LeanHistogram


def test_same_exposition_as_prometheus_histogram() -> None:
    bounds = (0.001, 0.01, 0.1, 1, 2.5)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    lean = LeanHistogram("x_seconds", "X", bounds, ours)
    reference = Histogram("x_seconds", "X", buckets=bounds, registry=theirs)
    # On a bound, between bounds, below the first, above the last.
    for value in (0.0005, 0.001, 0.05, 1, 3.0, 0.01, 100.0, 2.5):
        lean.observe(value)
        reference.observe(value)
    expected = [
        line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == expected
    assert 'x_seconds_bucket{le="0.001"} 2.0' in expected
    assert 'x_seconds_bucket{le="+Inf"} 8.0' in expected


def test_observe_all_is_observe_of_each() -> None:
    bounds = (0.001, 0.01, 0.1, 1)
    one, each = CollectorRegistry(), CollectorRegistry()
    values = [0.0005, 0.001, 0.1 / 3, 0.1 / 3, 0.1 / 3, 7.0, 0.01, 1e-9]
    LeanHistogram("x_seconds", "X", bounds, one).observe_all(values)
    by_each = LeanHistogram("x_seconds", "X", bounds, each)
    for value in values:
        by_each.observe(value)
    assert generate_latest(one) == generate_latest(each)
    assert b"x_seconds_count 8.0" in generate_latest(one)

"""Prometheus counters and gauges for the router's event-loop thread: `inc` is one addition,
no lock.

Why: prometheus_client's Counter and Gauge take a lock and check that the metric is
observable on every `inc`, `dec` and `set`, and `labels()` builds a key under a lock on
every call; a request moves ~12 of them (in flight up and down, its status, three prompt
token sources, generated tokens, two routing decisions, the admission gate's reserved
tokens twice). Only the event loop changes these values; a scrape (the /metrics route,
or prometheus_client's HTTP server thread) reads numbers the GIL keeps whole.

Exposed exactly as prometheus_client exposes a Counter (NAME_total and NAME_created per
label set) or a Gauge (NAME); label sets appear in the order they were first used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class LeanValue:
    """One series: `value` changed by the owner's thread only."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _LeanFamily:
    """Label values -> LeanValue; registered with `registry` as one metric family."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._children: dict[tuple[str, ...], LeanValue] = {}
        if not labelnames:
            self._children[()] = LeanValue()
        registry.register(self)

    def labels(self, *values: str) -> LeanValue:
        """The series of these label values (created at 0 on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            child = self._children[values] = LeanValue()
        return child

    def inc(self, amount: float = 1.0) -> None:
        self._children[()].value += amount

    def _series(self) -> list[tuple[tuple[str, ...], LeanValue]]:
        return list(self._children.items())

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError  # a counter or a gauge


class LeanCounter(_LeanFamily):
    """A Counter (`name` without the _total suffix, as prometheus_client takes it)."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in self._series():
            family.add_metric(list(values), child.value, created=child.created)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)


class LeanGauge(_LeanFamily):
    """A Gauge."""

    def dec(self, amount: float = 1.0) -> None:
        self._children[()].value -= amount

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in self._series():
            family.add_metric(list(values), child.value)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._documentation, labels=self._labelnames)

"""Prometheus series of one decode instance (names are a contract with deploy/grafana).

    kvserve_generated_tokens_total{instance, role}       tokens decode sampled and streamed
    kvserve_decode_requests_total{instance, outcome}     finished | aborted | rejected |
                                                         no_landing | no_kv | failed
    kvserve_landing_wait_seconds{instance}               /decode waiting for landing space
    kvserve_decode_scatter_seconds{instance, rank}       landing ring -> paged KV, one piece
    kvserve_handoff_flows_total{instance, result}        prefill stage flows closed: ok |
                                                         failed | aborted
    kvserve_landing_used_bytes{instance, rank}           landing bytes held by requests
    kvserve_landing_capacity_bytes{instance, rank}       the landing arena's size

plus the engine's series (enginehost/metrics.py) in the same registry. Landing bytes are
read from the arena at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enginehost.host import EngineHost
from enginehost.metrics import engine_registry
from protocol.messages import FlowClosed
from transfer import LandingArena

OUTCOMES = ("finished", "aborted", "rejected", "no_landing", "no_kv", "failed")
LANDING_WAIT_BUCKETS_S = (
    0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
SCATTER_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip


class LandingCollector(Collector):
    """Reads a landing arena's occupancy at scrape time (the arena is thread-safe)."""

    def __init__(self, arena: LandingArena, instance: str, rank: int) -> None:
        self.arena = arena
        self.labels = [instance, str(rank)]

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("kvserve_landing_used_bytes", "Landing bytes held by requests", self.arena.used_bytes),
            ("kvserve_landing_capacity_bytes", "Size of the landing arena", self.arena.total_bytes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["instance", "rank"])
            g.add_metric(self.labels, value)
            yield g


class DecodeMetrics:
    """Owns the registry of one decode instance (rank `rank`) and its collectors."""

    def __init__(
        self,
        instance: str,
        host: EngineHost,
        arena: LandingArena,
        num_devices: int,
        rank: int = 0,
    ) -> None:
        self.instance = instance
        self.registry: CollectorRegistry = engine_registry(host, instance, "decode", num_devices)
        r = self.registry
        r.register(LandingCollector(arena, instance, rank))
        self.generated_tokens = Counter(
            "kvserve_generated_tokens",
            "Tokens sampled (decode: every token after the first)",
            ["instance", "role"],
            registry=r,
        ).labels(instance, "decode")
        self.requests = Counter(
            "kvserve_decode_requests",
            "Decode requests by outcome",
            ["instance", "outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(instance, outcome)
        self.landing_wait = Histogram(
            "kvserve_landing_wait_seconds",
            "Time /decode waited for landing space (back-pressure from decode)",
            ["instance"],
            buckets=LANDING_WAIT_BUCKETS_S,
            registry=r,
        ).labels(instance)
        self.flows = Counter(
            "kvserve_handoff_flows",
            "Prefill stage flows of the handoff closed at this decode instance, by result",
            ["instance", "result"],
            registry=r,
        )
        for result in ("ok", "failed", "aborted"):
            self.flows.labels(instance, result)
        self.scatter_seconds = Histogram(
            "kvserve_decode_scatter_seconds",
            "Scatter of one landed piece of KV into paged KV",
            ["instance", "rank"],
            buckets=SCATTER_BUCKETS_S,
            registry=r,
        ).labels(instance, str(rank))

    def flow_closed(self, notice: FlowClosed) -> None:
        """A prefill stage closed its flow of a request (event loop)."""
        if notice.error is None:
            result = "ok"
        elif notice.error == "aborted":
            result = "aborted"
        else:
            result = "failed"
        self.flows.labels(self.instance, result).inc()

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.instance, outcome).inc()

"""Prometheus metrics of the router, in a registry the app owns (no global state).

kvserve_router_requests_total{endpoint, status}     finished requests by HTTP status
                                                    (499: the client went away)
kvserve_router_time_to_first_token_seconds          arrival -> first token from prefill
kvserve_router_inter_token_latency_seconds          gap between output tokens
kvserve_router_e2e_request_latency_seconds          arrival -> last token (200s only)
kvserve_router_prompt_tokens_total{source}          gpu | pool | computed (PromptUsage)
kvserve_router_generation_tokens_total
kvserve_router_requests_in_flight
kvserve_router_routed_total{policy, role, instance} routing decisions
kvserve_router_instance_healthy{role, instance}     1 healthy, 0 not
kvserve_router_admission_rejections_total{reason}   requests the admission gate turned away
kvserve_router_admission_waiting                    requests queued by the admission gate
kvserve_router_admission_wait_seconds               time a request queued at the gate

The scrape target's labels add instance="router" and role="router" (kvserve render
prometheus). Labelled series whose values are known are created at start (0), so a
dashboard shows 0 rather than "no data" before the first event.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from protocol.messages import PromptUsage
from router.instances import Instance, InstanceRegistry
from router.lean_counter import LeanCounter, LeanGauge, LeanValue
from router.lean_histogram import LeanHistogram
from router.output import RequestTiming

_TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1,
    1.5,
    2,
    3,
    5,
    7.5,
    10,
    15,
    20,
    30,
    60,
    120,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2.5,
)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
_ADMISSION_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
CLIENT_CLOSED_STATUS = 499
ADMISSION_REJECTION_REASONS = ("input_too_long", "kv_headroom", "queue_full", "wait_timeout")
"""Why the admission gate (DESIGN section 5.2) turns a request away."""


class RouterMetrics:
    """Owns the router's collectors; `registry` is what /metrics exposes."""

    def __init__(
        self, registry: CollectorRegistry | None = None, policy: str = "round_robin"
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.policy = policy
        """Name of the routing policy, the `policy` label of routing decisions."""
        r = self.registry
        p = "kvserve_router_"
        # What a request moves is lean (router/lean_counter.py, lean_histogram.py): one
        # addition each, no lock; the rest stays prometheus_client's.
        self.requests = LeanCounter(p + "requests", "Finished requests", ("endpoint", "status"), r)
        self.ttft = LeanHistogram(
            p + "time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS, r
        )
        self.itl = LeanHistogram(
            p + "inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS, r
        )
        self.e2e = LeanHistogram(
            p + "e2e_request_latency_seconds", "End-to-end latency", _E2E_BUCKETS, r
        )
        self.prompt_tokens = LeanCounter(
            p + "prompt_tokens", "Prompt tokens by source", ("source",), r
        )
        self.generation_tokens = LeanCounter(p + "generation_tokens", "Generated tokens", (), r)
        self.in_flight = LeanGauge(p + "requests_in_flight", "Requests being served", (), r)
        self.routed = LeanCounter(
            p + "routed", "Routing decisions", ("policy", "role", "instance"), r
        )
        self.healthy = Gauge(
            p + "instance_healthy", "Instance health (1 healthy)", ["role", "instance"], registry=r
        )
        self.admission_rejections = Counter(
            p + "admission_rejections",
            "Requests the admission gate turned away, by reason",
            ["reason"],
            registry=r,
        )
        for reason in ADMISSION_REJECTION_REASONS:
            self.admission_rejections.labels(reason)
        # Labelled children resolved once: `labels()` builds a key tuple on every call,
        # several times per request otherwise.
        self._routed: dict[tuple[str, str], LeanValue] = {}
        self._requests: dict[tuple[str, int], LeanValue] = {}
        self.prompt_gpu = self.prompt_tokens.labels("gpu")
        self.prompt_pool = self.prompt_tokens.labels("pool")
        self.prompt_computed = self.prompt_tokens.labels("computed")
        self.admission_waiting = Gauge(
            p + "admission_waiting", "Requests queued by the admission gate", registry=r
        )
        self.admission_wait = LeanHistogram(  # observed by every admitted request
            p + "admission_wait_seconds",
            "Time a request queued at the admission gate before it was admitted or rejected",
            _ADMISSION_WAIT_BUCKETS,
            r,
        )

    def watch_instances(self, instances: InstanceRegistry) -> None:
        """Export every instance's health, read at scrape time, and start its routing
        decisions at 0."""
        for inst in instances.all():
            self.healthy.labels(inst.role, inst.name).set_function(
                lambda i=inst: 1.0 if i.healthy else 0.0  # type: ignore[misc]
            )
            self.routed.labels(self.policy, inst.role, inst.name)

    def on_route(self, inst: Instance) -> None:
        key = (inst.role, inst.name)
        child = self._routed.get(key)
        if child is None:
            child = self._routed[key] = self.routed.labels(self.policy, inst.role, inst.name)
        child.inc()

    def requests_of(self, endpoint: str, status: int) -> LeanValue:
        """The finished-requests counter of (endpoint, status)."""
        key = (endpoint, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(endpoint, str(status))
        return child

    def on_rejected(self, reason: str) -> None:
        """The admission gate turned a request away (one of ADMISSION_REJECTION_REASONS)."""
        self.admission_rejections.labels(reason).inc()


class RequestRecord:
    """One request's metrics, counted exactly once by `finish` (in-flight until then)."""

    def __init__(self, metrics: RouterMetrics, endpoint: str) -> None:
        self._m = metrics
        self.endpoint = endpoint
        self.timing = RequestTiming(arrival=time.monotonic())
        self._finished = False
        metrics.in_flight.inc()

    def finish(
        self, status: int, usage: PromptUsage | None = None, num_output_tokens: int = 0
    ) -> None:
        if self._finished:
            return
        self._finished = True
        m, t = self._m, self.timing
        m.in_flight.dec()
        m.requests_of(self.endpoint, status).inc()
        if t.first_token is not None:
            m.ttft.observe(t.first_token - t.arrival)
        m.itl.observe_all(t.token_gaps)
        if status == 200:
            m.e2e.observe((t.last_token or time.monotonic()) - t.arrival)
        if usage is not None:
            m.prompt_gpu.inc(max(0, usage.gpu_tokens))
            m.prompt_pool.inc(max(0, usage.pool_tokens))
            m.prompt_computed.inc(max(0, usage.computed_tokens))
        if num_output_tokens:
            m.generation_tokens.inc(num_output_tokens)

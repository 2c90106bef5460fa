"""Prometheus series of one prefill instance (names are a contract with deploy/grafana).

    kvserve_prompt_tokens_total{instance, source}          gpu | pool | computed, per request
    kvserve_generated_tokens_total{instance, role}         first tokens sampled by prefill
    kvserve_prefill_requests_total{instance, outcome}      handed_off | finished | rejected |
                                                           handoff_failed | failed | aborted |
                                                           landing_expired
    kvserve_prefill_landing_grants_total{instance, outcome}  LandingGrants (POST /landing):
                                                           accepted | early | refused |
                                                           conflict | gone
    kvserve_prefill_landing_wait_seconds{instance}        an await_landing request's arrival
                                                           -> its grant applied
    kvserve_prefill_first_token_seconds{instance}          /prefill received -> first token
    kvserve_handoff_bytes_total{instance, stage}           KV bytes written to decode landing
    kvserve_handoff_ops_total{instance, stage}             transfer ops (each <= 8 MiB)
    kvserve_handoff_seconds{instance, stage}               one request's write time (sender threads)
    kvserve_handoff_request_bytes{instance, stage}         one request's handoff bytes

plus the engine's series (enginehost/metrics.py) in the same registry. Every labelled
counter is created at start for each of its known label values, so a dashboard shows a
0, not "no data", before the first event.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from enginehost.host import EngineHost
from enginehost.metrics import engine_registry
from protocol.handoff_messages import FlowResult
from protocol.messages import PromptUsage

OUTCOMES = (
    "handed_off", "finished", "rejected", "handoff_failed", "failed", "aborted", "landing_expired",
)  # fmt: skip
GRANT_OUTCOMES = ("accepted", "early", "refused", "conflict", "gone")
SOURCES = ("gpu", "pool", "computed")
FIRST_TOKEN_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60,
)  # fmt: skip
HANDOFF_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
HANDOFF_BUCKETS_BYTES = tuple(float(64 * 1024 * 4**k) for k in range(10))
"""64 KiB ... 16 GiB: a 100K-token history of a GLM-5-class model is ~5 GB."""


class PrefillMetrics:
    """Owns the registry of one prefill instance (stage `stage`) and its collectors."""

    def __init__(self, instance: str, host: EngineHost, num_devices: int, stage: int = 0) -> None:
        self.instance = instance
        self.registry: CollectorRegistry = engine_registry(host, instance, "prefill", num_devices)
        r = self.registry
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens",
            "Prompt tokens by where their KV came from (each counted once)",
            ["instance", "source"],
            registry=r,
        )
        for source in SOURCES:
            self.prompt_tokens.labels(instance, source)
        self.generated_tokens = Counter(
            "kvserve_generated_tokens",
            "Tokens sampled (prefill: the first token of each request)",
            ["instance", "role"],
            registry=r,
        ).labels(instance, "prefill")
        self.requests = Counter(
            "kvserve_prefill_requests",
            "Prefill requests by outcome",
            ["instance", "outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(instance, outcome)
        self.first_token_seconds = Histogram(
            "kvserve_prefill_first_token_seconds",
            "From /prefill received to the first token sampled (queue + restore + compute)",
            ["instance"],
            buckets=FIRST_TOKEN_BUCKETS_S,
            registry=r,
        ).labels(instance)
        self.landing_grants = Counter(
            "kvserve_prefill_landing_grants",
            "LandingGrants (decode's landing for a request sent beside decode's) by outcome",
            ["instance", "outcome"],
            registry=r,
        )
        for outcome in GRANT_OUTCOMES:
            self.landing_grants.labels(instance, outcome)
        self.landing_wait_seconds = Histogram(
            "kvserve_prefill_landing_wait_seconds",
            "From an await_landing request's arrival to its LandingGrant applied",
            ["instance"],
            buckets=HANDOFF_BUCKETS_S,
            registry=r,
        ).labels(instance)
        self.handoff_bytes = Counter(
            "kvserve_handoff_bytes",
            "KV bytes written to decode landing buffers",
            ["instance", "stage"],
            registry=r,
        )
        self.handoff_ops = Counter(
            "kvserve_handoff_ops",
            "Transfer ops (each at most 8 MiB) of the handoff",
            ["instance", "stage"],
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "kvserve_handoff_seconds",
            "One request's handoff time on this stage (the sender threads' write time)",
            ["instance", "stage"],
            buckets=HANDOFF_BUCKETS_S,
            registry=r,
        )
        self.handoff_request_bytes = Histogram(
            "kvserve_handoff_request_bytes",
            "One request's handoff bytes on this stage",
            ["instance", "stage"],
            buckets=HANDOFF_BUCKETS_BYTES,
            registry=r,
        )

        for m in (
            self.handoff_bytes,
            self.handoff_ops,
            self.handoff_seconds,
            self.handoff_request_bytes,
        ):
            m.labels(instance, str(stage))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.instance, outcome).inc()

    def grant(self, outcome: str) -> None:
        self.landing_grants.labels(self.instance, outcome).inc()

    def landing_waited(self, seconds: float) -> None:
        self.landing_wait_seconds.observe(seconds)

    def count_prompt(self, usage: PromptUsage) -> None:
        for source, n in (
            ("gpu", usage.gpu_tokens),
            ("pool", usage.pool_tokens),
            ("computed", usage.computed_tokens),
        ):
            self.prompt_tokens.labels(self.instance, source).inc(max(0, n))

    def first_token(self, usage: PromptUsage, seconds: float) -> None:
        self.count_prompt(usage)
        self.generated_tokens.inc()
        self.first_token_seconds.observe(seconds)

    def handoff_closed(self, request_id: str, stages: list[FlowResult]) -> None:
        """Every stage closed its flow of a request (stage order): count what moved."""
        for stage, res in enumerate(stages):
            labels = (self.instance, str(stage))
            self.handoff_bytes.labels(*labels).inc(res.num_bytes)
            self.handoff_ops.labels(*labels).inc(res.num_ops)
            self.handoff_seconds.labels(*labels).observe(res.seconds)
            self.handoff_request_bytes.labels(*labels).observe(res.num_bytes)
        errors = [r.error for r in stages if r.error is not None]
        if not errors:
            self.outcome("handed_off")
        elif all(e == "aborted" for e in errors):
            self.outcome("aborted")
        else:
            self.outcome("handoff_failed")

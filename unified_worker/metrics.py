"""Prometheus series of one unified instance (names are a contract with deploy/grafana).

    kvserve_prompt_tokens_total{instance, source}           gpu | pool | computed, per request
    kvserve_generated_tokens_total{instance, role}          every token sampled (role="unified")
    kvserve_unified_requests_total{instance, outcome}       finished | rejected | failed | aborted
    kvserve_unified_first_token_seconds{instance}           /generate received -> first token

plus the engine's series (enginehost/metrics.py, role="unified") and the pool's
(kvpool/metrics.py) in the same registry. The prompt-token series is the one prefill
instances export, so reuse panels sum over both topologies.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from enginehost.host import EngineHost
from enginehost.metrics import engine_registry
from prefill_worker.metrics import FIRST_TOKEN_BUCKETS_S, SOURCES
from protocol.messages import PromptUsage

ROLE = "unified"
OUTCOMES = ("finished", "rejected", "failed", "aborted")


class UnifiedMetrics:
    """Owns the registry of one unified instance and its collectors."""

    def __init__(self, instance: str, host: EngineHost, num_devices: int = 1) -> None:
        self.instance = instance
        self.registry: CollectorRegistry = engine_registry(host, instance, ROLE, num_devices)
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
            "Tokens sampled (unified: every token of every request)",
            ["instance", "role"],
            registry=r,
        ).labels(instance, ROLE)
        self.requests = Counter(
            "kvserve_unified_requests",
            "Unified requests by outcome",
            ["instance", "outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(instance, outcome)
        self.first_token_seconds = Histogram(
            "kvserve_unified_first_token_seconds",
            "From /generate received to the first token sampled (queue + restore + compute)",
            ["instance"],
            buckets=FIRST_TOKEN_BUCKETS_S,
            registry=r,
        ).labels(instance)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.instance, outcome).inc()

    def first_token(self, usage: PromptUsage, seconds: float) -> None:
        for source, n in (
            ("gpu", usage.gpu_tokens),
            ("pool", usage.pool_tokens),
            ("computed", usage.computed_tokens),
        ):
            self.prompt_tokens.labels(self.instance, source).inc(max(0, n))
        self.first_token_seconds.observe(seconds)

"""Prometheus series every engine host exports, read from the engine at each scrape.

    kvserve_kv_cache_usage_ratio{instance, role}          KV blocks held by requests / all
    kvserve_kv_cache_blocks{instance, role, state}        total | free | cached blocks
    kvserve_num_requests_running{instance, role}          in the running batch
    kvserve_num_requests_waiting{instance, role}          queued, not admitted yet
    kvserve_num_requests_loading_kv{instance, role}       admitted, waiting for pool KV
    kvserve_prefix_cache_evictions_total{instance, role}  cached blocks reused for new KV
    kvserve_engine_preemptions_total{instance, role}      requests preempted (recompute)
    kvserve_engine_recomputed_tokens_total{instance, role}
    kvserve_engine_admissions_deferred_total{instance, role}  steps a prompt waited for
                                                          blocks (whole_prompt admission)
    kvserve_engine_kv_loads_total{instance, role}         external (pool) loads started
    kvserve_engine_kv_loads_short_total{instance, role}   loads that brought fewer tokens
    kvserve_instance_devices{instance, role}              devices (GPUs, or CPU processes)
                                                          the instance runs on

A scrape never waits for the engine thread: a stuck step must not stop the metrics that
show it. Each value is one read of an int or a container length, atomic under the GIL;
values of one scrape may straddle a step (running + waiting can miss a request that moves
between them), which is fine for monitoring.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enginehost.host import EngineHost

LABELS = ["instance", "role"]


class EngineCollector(Collector):
    """Reads one engine's KV occupancy, queues and scheduler counters at scrape time."""

    def __init__(self, host: EngineHost, instance: str, role: str, num_devices: int) -> None:
        self.host = host
        self.labels = [instance, role]
        self.num_devices = num_devices

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.labels, value)
        return c

    def collect(self) -> Iterator[Metric]:
        e = self.host.engine
        pool, sched, counters = e.pool, e.scheduler, e.counters
        yield self._gauge(
            "kvserve_kv_cache_usage_ratio",
            "Fraction of paged KV blocks held by requests (cached free blocks count as free)",
            pool.usage(),
        )
        blocks = GaugeMetricFamily(
            "kvserve_kv_cache_blocks", "Paged KV blocks by state", labels=[*LABELS, "state"]
        )
        blocks.add_metric([*self.labels, "total"], pool.num_blocks)
        blocks.add_metric([*self.labels, "free"], pool.num_free_blocks)
        blocks.add_metric([*self.labels, "cached"], pool.num_cached_blocks)
        yield blocks
        yield self._gauge(
            "kvserve_num_requests_running", "Requests in the running batch", len(sched.running)
        )
        yield self._gauge(
            "kvserve_num_requests_waiting",
            "Requests queued for admission to the batch",
            len(sched.waiting),
        )
        yield self._gauge(
            "kvserve_num_requests_loading_kv",
            "Requests admitted and waiting for their KV from the pool",
            len(sched.loading),
        )
        yield self._counter(
            "kvserve_prefix_cache_evictions",
            "Prefix-cached blocks whose content was evicted for new KV",
            pool.num_evictions,
        )
        yield self._counter(
            "kvserve_engine_preemptions",
            "Requests preempted (recomputed later)",
            counters.preemptions,
        )
        yield self._counter(
            "kvserve_engine_recomputed_tokens",
            "Tokens computed again after a preemption (computed before it, not found again)",
            counters.recomputed_tokens,
        )
        yield self._counter(
            "kvserve_engine_admissions_deferred",
            "Engine steps whose admission stopped at a waiting prompt that does not fit beside "
            "what the running ones still need (whole_prompt admission)",
            counters.admissions_deferred,
        )
        yield self._counter(
            "kvserve_engine_kv_loads", "External (pool) KV loads started", counters.loads_started
        )
        yield self._counter(
            "kvserve_engine_kv_loads_short",
            "External KV loads that brought fewer tokens than matched (rest recomputed)",
            counters.loads_short,
        )
        yield self._gauge(
            "kvserve_instance_devices",
            "Devices (GPUs, or CPU processes) the instance runs on; throughput per GPU "
            "divides by their sum",
            self.num_devices,
        )


def engine_registry(
    host: EngineHost, instance: str, role: str, num_devices: int
) -> CollectorRegistry:
    """A fresh registry (one per worker process) holding the engine collector."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(host, instance, role, num_devices))
    return registry


def serve_metrics_port(registry: CollectorRegistry, host: str, port: int | None) -> None:
    """Also serve `registry` on `port` (cluster.yaml `metrics_port`) from prometheus_client's
    own HTTP thread, bound to the node's host; None: /metrics only on the worker's port."""
    if port is not None:
        start_http_server(port, addr=host, registry=registry)

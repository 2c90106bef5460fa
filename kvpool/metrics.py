"""Prometheus series of the pool, as a prefill instance exports them.

Names are a contract with the Grafana dashboards (deploy/grafana): change them only with
the dashboards. Every series has the `instance` label; counters end in `_total` in the
exposition (prometheus_client adds it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol.pool_messages import PoolCounts

FAILURE_OPS = ("lookup", "load", "save", "remove")
"""Operations of kvserve_pool_failures_total{op}; reasons vary (Mooncake status codes)."""
RESTORE_PHASES = (
    "locate",  # where the objects are, to read those in this process's own segment in
    # place (Mooncake batch_get_replica_desc; wall time)
    "read",  # the pool read into the load slots (Mooncake get_into; wall time)
    "check",  # size and header checks on the host (+ payload checksums without a GPU)
    "unpack",  # CPU engine: payloads from the slots into the KV blocks
    "device",  # GPU engine: the load thread's time in the device pipeline (queueing the
    # copies, checksums and unpacks, and waiting for them)
    "h2d_gpu",  # GPU stream time of the copies out of the load slots (pinned -> device)
    "checksum_gpu",  # GPU stream time of the payload checksums
    "unpack_gpu",  # GPU stream time of the unpacks into the pages
)
"""Phases of kvserve_pool_restore_phase_seconds_total. Host phases are wall time of the
load thread; *_gpu phases are time on the device's streams (they overlap each other and
the host phases)."""
RESTORE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)


class PoolMetrics:
    """The pool's collectors in one registry, pre-bound to an instance name."""

    def __init__(self, registry: CollectorRegistry, instance: str) -> None:
        self.instance = instance
        labels = {"instance": instance}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["instance"], registry=registry)

        self.lookups = counter("kvserve_pool_lookups", "Pool lookups (batched existence checks)")
        self.lookups_i = self.lookups.labels(**labels)
        self.hit_chunks = counter(
            "kvserve_pool_hit_chunks", "Chunks a lookup found in every stage (restorable)"
        ).labels(**labels)
        self.miss_chunks = counter(
            "kvserve_pool_miss_chunks", "Chunks a lookup asked for but could not restore"
        ).labels(**labels)
        self.load_bytes = counter(
            "kvserve_pool_load_bytes", "Object bytes read from the pool and verified"
        ).labels(**labels)
        self.save_bytes = counter(
            "kvserve_pool_save_bytes", "Object bytes written to the pool"
        ).labels(**labels)
        self.save_chunks = counter(
            "kvserve_pool_save_chunks", "Chunks saved (every stage's object stored)"
        ).labels(**labels)
        self.restored_tokens = counter(
            "kvserve_pool_restored_tokens", "Prompt tokens restored from the pool"
        ).labels(**labels)
        self.restore_seconds = Histogram(
            "kvserve_pool_restore_seconds",
            "One stage's part of a restore: read, verify, unpack",
            ["instance", "stage"],
            buckets=RESTORE_BUCKETS_S,
            registry=registry,
        )
        self.restore_wait_seconds = Histogram(
            "kvserve_pool_restore_wait_seconds",
            "From the first stage starting a restore to the last stage done",
            ["instance"],
            buckets=RESTORE_BUCKETS_S,
            registry=registry,
        ).labels(**labels)
        self.save_queue_depth = Gauge(
            "kvserve_pool_save_queue_depth",
            "Chunks packed and waiting to be written to the pool",
            ["instance"],
            registry=registry,
        ).labels(**labels)
        self.save_dropped = counter(
            "kvserve_pool_save_dropped", "Chunks not saved because the save queue was full"
        ).labels(**labels)
        self.retention_removed = counter(
            "kvserve_pool_retention_removed",
            "Chunks this instance removed from the pool itself to stay within its retention "
            "budget (pool.retention: client; kvpool/retention.py)",
        ).labels(**labels)
        self.retained_chunks = Gauge(
            "kvserve_pool_retained_chunks",
            "Chunks this instance saved and still counts against its retention budget",
            ["instance"],
            registry=registry,
        ).labels(**labels)
        self.failures = Counter(
            "kvserve_pool_failures",
            "Pool operations that failed, by operation and reason",
            ["instance", "op", "reason"],
            registry=registry,
        )
        for op in FAILURE_OPS:  # at 0 from start: a failures panel shows 0, not "no data"
            self.failures.labels(instance=instance, op=op, reason="unreachable")
        self.stage_objects_total = Counter(
            "kvserve_pool_stage_objects",
            "Objects one pipeline stage stored (op=save) or read, verified and unpacked "
            "(op=load) from its own process",
            ["instance", "stage", "op"],
            registry=registry,
        )
        self.restore_phase_seconds = Counter(
            "kvserve_pool_restore_phase_seconds",
            "Restore time by stage and phase (RESTORE_PHASES): where a restore's time goes",
            ["instance", "stage", "phase"],
            registry=registry,
        )
        self.load_in_place = counter(
            "kvserve_pool_load_in_place_objects",
            "Objects read in place from this process's own pool segment (no copy)",
        ).labels(**labels)
        self.checksum_failures = counter(
            "kvserve_pool_checksum_failures",
            "Objects read that did not match (header, size or payload checksum): removed",
        ).labels(**labels)

    def failure(self, op: str, reason: str, n: int = 1) -> None:
        self.failures.labels(instance=self.instance, op=op, reason=reason).inc(n)

    def lookup(self, num_hit: int, num_miss: int) -> None:
        self.lookups_i.inc()
        self.hit_chunks.inc(num_hit)
        self.miss_chunks.inc(num_miss)

    def stage_objects(self, op: str, stage: int, n: int) -> None:
        self.stage_objects_total.labels(instance=self.instance, stage=str(stage), op=op).inc(n)

    def restore(self, stage: int, seconds: float) -> None:
        self.restore_seconds.labels(instance=self.instance, stage=str(stage)).observe(seconds)

    def restore_phase(self, stage: int, phase: str, seconds: float) -> None:
        self.restore_phase_seconds.labels(
            instance=self.instance, stage=str(stage), phase=phase
        ).inc(seconds)

    def apply(self, c: PoolCounts) -> None:
        """Add a worker's counts (kvpool/stats.py) to these series."""
        if c.lookups:
            self.lookups_i.inc(c.lookups)
        self.hit_chunks.inc(c.hit_chunks)
        self.miss_chunks.inc(c.miss_chunks)
        self.load_bytes.inc(c.load_bytes)
        self.save_bytes.inc(c.save_bytes)
        self.checksum_failures.inc(c.checksum_failures)
        self.load_in_place.inc(c.load_in_place)
        self.save_dropped.inc(c.save_dropped)
        for f in c.failures:
            self.failure(f.op, f.reason, f.count)
        for stage, seconds in c.restore_seconds:
            self.restore(stage, seconds)
        for stage, n in c.saved_objects:
            self.stage_objects("save", stage, n)
        for stage, n in c.loaded_objects:
            self.stage_objects("load", stage, n)
        for stage, phase, seconds in c.restore_phases:
            self.restore_phase(stage, phase, seconds)

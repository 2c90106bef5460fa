"""Builders of a prefill process's pool parts from cluster.yaml: its PoolClient (the
mooncake backend on its node's master, or the "none" backend when the pool is off) and
its retention policy (pool.retention). The connector itself: pool_connector.py."""

from __future__ import annotations

import torch

from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.retention import LruChainRetention, Retention
from kvpool.stats import StageCounters
from kvpool.topology import (
    master_address,
    master_http_address,
    prefill_segment,
    retention_share_bytes,
)
from protocol.cluster import ClusterConfig, PoolInstance
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace


def build_pool_client(
    cluster: ClusterConfig,
    inst: PoolInstance,
    namespace: KVNamespace,
    layout: KVLayout,
    counters: StageCounters,
    stage: int | None,
    device: torch.device,
) -> PoolClient:
    """A prefill process's client: the "mooncake" backend on its node's master (shared
    or split pool), or the "none" backend when the pool is off. `stage`: the one pool
    stage this process holds (PP > 1), None for every stage (PP = 1)."""
    pool = cluster.pool
    node = cluster.node(inst.node)
    if pool is not None and pool.enabled:
        segment, hugepages = prefill_segment(cluster, inst.name)  # pool.stores[].prefill
        config = BackendConfig(
            node.host,
            master_address(cluster, inst.node),
            pool.protocol,
            segment_bytes=segment,
            hugepages=hugepages,
            master_http=master_http_address(cluster, inst.node),  # for in-place reads
            lease_ttl_s=pool.master.lease_ttl_s,
        )
        backend = create_backend("mooncake", config)
        buffer_bytes: int | None = int(inst.pool_buffer_memory)
        depth = pool.save_queue_depth
    else:
        backend = create_backend("none", BackendConfig(node.host, ""))
        buffer_bytes, depth = None, 1
    return PoolClient(
        backend,
        namespace,
        layout,
        buffer_bytes=buffer_bytes,
        max_save_chunks=depth,
        metrics=counters,
        local_stages=None if stage is None else [stage],
        pin_memory=device.type == "cuda",
    )


def build_retention(cluster: ClusterConfig, inst: PoolInstance, client: PoolClient) -> Retention:
    """The instance's retention policy (pool.retention): "client" keeps its saved chunks
    within its share of the pool (kvpool/retention.py), "mooncake" leaves it to the
    master."""
    pool = cluster.pool
    if pool is None or not pool.enabled or pool.retention != "client":
        return Retention()
    chunk_bytes = sum(spec.object_bytes for spec in client.specs.values())
    return LruChainRetention(max(1, retention_share_bytes(cluster, inst.name) // chunk_bytes))

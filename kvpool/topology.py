"""Who talks to which master, and how a store service is bound to its NUMA node.

Shared pool (`pool.shared: true`): one master on `pool.master.node`; every store service
and every prefill instance of every node uses it.

Split pool (`pool.shared: false`): every node with a store runs its own master (same
`pool.master` settings, on that node's host), and its stores and prefill instances use
that one: one independent pool per server, the reference's "split pool". The cluster
checks make sure every prefill node has a store, hence a master.

    shared:  node A: prefill, store ─┐          split:  node A: prefill, store ─▶ master A
             node B: prefill, store ─┴▶ master          node B: prefill, store ─▶ master B
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from protocol.cluster import ClusterConfig, PoolConfig, PoolInstance, PoolStoreConfig


def _pool(cluster: ClusterConfig) -> PoolConfig:
    if cluster.pool is None:
        raise ValueError("the cluster has no pool section")
    return cluster.pool


def master_nodes(cluster: ClusterConfig) -> list[str]:
    """Nodes that run a master: the master node (shared) or every store node (split)."""
    pool = _pool(cluster)
    if pool.shared:
        return [pool.master.node]
    return list(dict.fromkeys(s.node for s in pool.stores))


def master_address(cluster: ClusterConfig, node: str) -> str:
    """host:port of the master that processes on `node` use."""
    pool = _pool(cluster)
    host = cluster.node(pool.master.node if pool.shared else node).host
    return f"{host}:{pool.master.port}"


def master_http_address(cluster: ClusterConfig, node: str) -> str:
    """host:port of the HTTP (metrics/admin) server of the master that `node` uses."""
    pool = _pool(cluster)
    host = cluster.node(pool.master.node if pool.shared else node).host
    return f"{host}:{pool.master.metrics_port}"


def master_component(cluster: ClusterConfig, node: str) -> str:
    """Component name of the master running on `node`."""
    return "pool-master" if _pool(cluster).shared else f"pool-master-{node}"


def store_component(index: int) -> str:
    return f"pool-store-{index}"


def service_stores(cluster: ClusterConfig) -> list[tuple[int, PoolStoreConfig]]:
    """(index, store) of every store that runs as its own store-service process (not
    mounted in a prefill instance)."""
    return [(i, s) for i, s in enumerate(_pool(cluster).stores) if s.prefill is None]


def prefill_segment(cluster: ClusterConfig, instance: str) -> tuple[int, bool]:
    """(bytes, hugepages) of the segment each stage process of prefill `instance` mounts:
    its store's size split over its stages, or (0, False) when it has none (a pure
    client)."""
    pool = cluster.pool
    if pool is None or not pool.enabled:
        return 0, False
    for s in pool.stores:
        if s.prefill == instance:
            pp = next(p.pipeline_parallel for p in cluster.prefill if p.name == instance)
            return int(s.size) // pp, s.hugepages
    return 0, False


def retention_share_bytes(cluster: ClusterConfig, instance: str) -> int:
    """Pool bytes pool instance `instance` may fill with its saves under retention
    "client": retention_budget of the stores its master pools (all of them when shared,
    its node's when split), split evenly among the pool instances using that master."""
    pool = _pool(cluster)
    insts: list[PoolInstance] = [*cluster.prefill, *cluster.unified]
    node = next(i.node for i in insts if i.name == instance)
    if pool.shared:
        stores, writers = pool.stores, insts
    else:
        stores = tuple(s for s in pool.stores if s.node == node)
        writers = [i for i in insts if i.node == node]
    total = sum(int(s.size) for s in stores)
    return int(total * pool.retention_budget) // max(1, len(writers))


@dataclass(frozen=True)
class NumaPlan:
    """How to start a store service for its numa_node."""

    argv_prefix: tuple[str, ...]
    """("numactl", "--cpunodebind=N", "--membind=N") or () for no binding."""
    message: str
    """One log line saying what was decided and why."""


def host_numa_nodes(sysfs: str = "/sys/devices/system/node") -> list[int]:
    """NUMA node ids of this host (empty when sysfs does not say)."""
    try:
        names = os.listdir(sysfs)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"node(\d+)", n)))


def numa_plan(
    numa_node: int | None,
    *,
    sysfs: str = "/sys/devices/system/node",
    which: Callable[[str], str | None] = shutil.which,
) -> NumaPlan:
    """Bind with numactl when the host has several NUMA nodes and numa_node is set;
    otherwise (or without numactl) run unbound, saying why."""
    if numa_node is None:
        return NumaPlan((), "no numa_node set: store runs unbound")
    nodes = host_numa_nodes(sysfs)
    if len(nodes) < 2:
        return NumaPlan(
            (), f"host has {len(nodes) or 'no'} NUMA node(s): numa_node {numa_node} ignored"
        )
    if numa_node not in nodes:
        raise ValueError(f"numa_node {numa_node} does not exist on this host (nodes: {nodes})")
    if which("numactl") is None:
        return NumaPlan(
            (),
            f"numactl not found: store for NUMA node {numa_node} runs unbound "
            "(install numactl to bind CPU and memory)",
        )
    return NumaPlan(
        ("numactl", f"--cpunodebind={numa_node}", f"--membind={numa_node}"),
        f"binding to NUMA node {numa_node} with numactl",
    )


def hugepage_report(meminfo: str = "/proc/meminfo") -> str:
    """ "HugePages_Free 0 of 0 (2048 kB each)": what the kernel has reserved."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return "unknown (no /proc/meminfo)"
    vals = dict(re.findall(r"^(HugePages_Total|HugePages_Free|Hugepagesize):\s+(\d+)", text, re.M))
    return (
        f"HugePages_Free {vals.get('HugePages_Free', '?')} of "
        f"{vals.get('HugePages_Total', '?')} ({vals.get('Hugepagesize', '?')} kB each)"
    )

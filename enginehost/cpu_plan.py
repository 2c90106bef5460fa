"""Which CPUs and how many threads each CPU engine process of a node gets.

Every torch CPU engine defaults to one OpenMP thread per core plus an inter-op pool of
as many; a prefill and a decode process on one small host then oversubscribe the cores,
OpenMP's spinning barriers make each step many times slower, and the kernel migrates
threads between cores (cold caches). The plan gives the node's engine processes
disjoint slices of the CPUs this process may run on, in a fixed order (prefill
instances' stages, then decode instances' ranks, then unified instances, as cluster.yaml
lists them):

    2 CPUs, prefill-0 + decode-0        prefill-0 -> {0}, decode-0 -> {1}
    2 CPUs, unified-0                   unified-0 -> {0, 1}
    8 CPUs, prefill (PP 2) + decode     stage 0 -> {0,1}, stage 1 -> {2,3}, decode -> {4..7}

with one torch thread per CPU of its slice and one inter-op thread. With more engine
processes than CPUs, or `cpu_pinning: false`, no process is pinned and each gets
cpus // processes threads (at least one). The router and the pool's Mooncake services
are not pinned: they are mostly idle and take whichever core is free.

A unified instance owns every CPU of its slice but shares them with the router, its own
event loop and, on a small box, the clients: its pure-decode steps run on one thread
fewer (`decode_threads`, engine/step_threads.py), steps with prefill rows on all of them.
Decode is bound by memory bandwidth, which one core nearly saturates here, and a step on
fewer threads does not wait at a barrier for a thread the router preempted
(docs/benchmarks.md, "Decode steps on one thread"). KVSERVE_CPU_DECODE_THREADS (the
instance's `env:` in cluster.yaml) sets the count instead, for A/B runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from protocol.cluster import ClusterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSlot:
    """One engine process's share: its CPUs (None: not pinned) and torch threads."""

    cpus: tuple[int, ...] | None
    threads: int
    decode_threads: int | None = None
    """Torch threads for steps that only decode; None: `threads`."""


DECODE_THREADS_ENV = "KVSERVE_CPU_DECODE_THREADS"
"""Overrides a slot's decode_threads (1 .. threads), e.g. = threads for every step alike."""


def _decode_threads(cluster: ClusterConfig, name: str, threads: int) -> int | None:
    """One fewer than `threads` for a unified instance (it shares its CPUs with the
    request path), the env override if set; None: the same as every step."""
    env = os.environ.get(DECODE_THREADS_ENV)
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"{DECODE_THREADS_ENV} must be >= 1, got {env!r}")
        return min(n, threads)
    unified = any(u.name == name for u in cluster.unified)
    return threads - 1 if unified and threads > 1 else None


def engine_processes(cluster: ClusterConfig, node: str) -> list[tuple[str, int]]:
    """(instance name, stage or rank) of every CPU engine process on `node`, in plan order."""
    procs = [
        (p.name, s)
        for p in cluster.prefill
        if p.node == node
        for s, d in enumerate(p.devices)
        if str(d) == "cpu"
    ]
    procs += [
        (d.name, r)
        for d in cluster.decode
        if d.node == node
        for r, dev in enumerate(d.devices)
        if str(dev) == "cpu"
    ]
    procs += [(u.name, 0) for u in cluster.unified if u.node == node and str(u.devices[0]) == "cpu"]
    return procs


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def plan_slot(
    cluster: ClusterConfig, node: str, name: str, index: int, cpus: list[int] | None = None
) -> CpuSlot:
    """The slot of process (`name`, stage / rank `index`) on `node`."""
    cpus = available_cpus() if cpus is None else cpus
    procs = engine_processes(cluster, node)
    n = max(1, len(procs))
    if (name, index) not in procs or not cluster.cpu_pinning or len(cpus) < n:
        threads = max(1, len(cpus) // n)
        return CpuSlot(None, threads, _decode_threads(cluster, name, threads))
    i = procs.index((name, index))
    per = len(cpus) // n
    extra = len(cpus) % n  # the first `extra` processes take one CPU more
    start = i * per + min(i, extra)
    mine = tuple(cpus[start : start + per + (i < extra)])
    return CpuSlot(mine, len(mine), _decode_threads(cluster, name, len(mine)))


def apply_slot(slot: CpuSlot) -> None:
    """Pin this process (all its threads created from now on inherit the mask) and size
    torch's pools. Call before the engine is built: the OpenMP pool starts on the first
    parallel op."""
    import torch  # here: `kvserve check` reads the plan without loading torch

    if slot.cpus is not None:
        try:
            os.sched_setaffinity(0, slot.cpus)
        except (AttributeError, OSError) as e:  # not Linux, or a CPU outside our cpuset
            log.warning("cannot pin to CPUs %s: %s", list(slot.cpus), e)
    torch.set_num_threads(slot.threads)
    # the engine thread launches ops one at a time; RuntimeError: inter-op work already
    # ran (the pool exists), keep it
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    log.info(
        "CPU engine: %d thread(s) (%d for decode-only steps), CPUs %s",
        slot.threads,
        slot.decode_threads or slot.threads,
        slot.cpus or "not pinned",
    )


def describe_plan(cluster: ClusterConfig, node: str, cpus: list[int] | None = None) -> list[str]:
    """One line per CPU engine process of `node`: its CPUs and torch threads (kvserve check)."""
    lines = []
    for name, index in engine_processes(cluster, node):
        slot = plan_slot(cluster, node, name, index, cpus)
        where = f"CPUs {list(slot.cpus)}" if slot.cpus is not None else "not pinned"
        line = f"{name} process {index}: {where}, {slot.threads} torch thread(s)"
        if slot.decode_threads is not None and slot.decode_threads != slot.threads:
            line += f" ({slot.decode_threads} for decode-only steps)"
        lines.append(line)
    return lines


def setup_cpu_engine(cluster: ClusterConfig, node: str, name: str, index: int) -> CpuSlot:
    """plan_slot + apply_slot for this process; its slot."""
    slot = plan_slot(cluster, node, name, index)
    apply_slot(slot)
    return slot

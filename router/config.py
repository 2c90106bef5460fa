"""RouterSettings: the router's frozen configuration, built from cluster.yaml's `router`
section (plus the instance lists and the model) or directly by tests and benchmarks."""

from __future__ import annotations

import logging
import os
from typing import Annotated, Literal

import msgspec

from protocol.cluster import ClusterConfig, PoolInstance
from router.http_limits import HttpLimits
from router.policies import policy_names

log = logging.getLogger(__name__)

FALLBACK_POLICY = "round_robin"


class InstanceEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where the router reaches one worker instance."""

    name: str
    url: str
    """Base URL, e.g. "http://127.0.0.1:8101"."""
    pool: str | None = None
    """Prefill or unified: the pool it saves to and restores from (same id = same pool);
    None: none."""


class RouterSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the router process needs; see cluster.yaml's `router` section for the
    meaning of the shared fields."""

    model: str
    """Model spec (HF folder, .gguf, builtin:...): tokenizer, chat template, context length."""
    served_model_name: str | None = None
    """Name clients use; None: the model's own name. The spec itself is accepted too."""
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    """0: an ephemeral port (tests)."""
    policy: str = FALLBACK_POLICY
    policy_seed: int | None = None
    """Seed of the random policy (reproducible runs)."""
    api_key: str | None = None
    cluster_secret: str | None = None
    """Sent with every call to a worker (protocol/internal_auth.py); `python -m router`
    takes it from KVSERVE_CLUSTER_SECRET. None: calls carry none (stand-in workers)."""
    max_input_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """Connecting to a worker; a refused connection fails at once anyway."""
    health_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Period of the GET /health poll of every instance (router/health.py)."""
    health_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Longest one GET /health poll waits for its answer (router/health.py)."""
    metrics_port: int | None = None
    """Also serve /metrics on this port (prometheus_client's own server); None: only on
    the API port. Router process i serves its own on metrics_port + i."""
    processes: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Router processes sharing `port` with SO_REUSEPORT (router/processes.py)."""
    process_index: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Which of them this is (0 starts and watches the others)."""
    prefill: tuple[InstanceEndpoint, ...] = ()
    decode: tuple[InstanceEndpoint, ...] = ()
    unified: tuple[InstanceEndpoint, ...] = ()
    """Instances that prefill and decode in one engine: given any, every request goes to
    one of them in a single call (router/unified.py) and prefill / decode are empty."""
    block_size: int = 16
    """Tokens per KV block, for policies that hash the prompt."""
    pool_capacity_bytes: dict[str, int] = {}
    """Pool id -> DRAM of its stores (the router's pool index holds that much, by LRU)."""
    kv_poll_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.05
    """The longest a worker holds back KV events and load on its push stream (GET
    /kv_events/stream, one per instance; KV-aware routing and the gate read them)."""
    admission: bool = True
    """False: no admission gate (requests go straight to decode's /decode)."""
    admission_wait_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    admission_headroom: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    admission_max_waiting: Annotated[int, msgspec.Meta(ge=0)] = 1024
    admission_order: Literal["fifo", "fits_first"] = "fifo"
    """fifo or fits_first (router/admission_order.py)."""
    admission_pass_bound_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Longest completion accepted (and the default max_tokens cap); None: the context."""
    tool_parser: str | None = None
    """hermes, llama3_json or mistral; None: picked from the chat template."""
    session_headers: tuple[str, ...] = (
        "x-session-id",
        "x-session-affinity",
        "x-claude-code-session-id",
        "session_id",
        "session-id",
        "conversation_id",
        "x-conversation-id",
    )
    """Request headers naming the client's session (first present wins), else `user`."""
    http_limits: HttpLimits = HttpLimits()
    """Sizes and timeouts of a request's headers and body (router/http_limits.py)."""
    data_plane: Literal["python", "native"] = "python"
    """native: kvserve-edge serves `host`:`port` and this router listens on loopback only,
    as its control plane (router/edge.py)."""
    edge_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The edge's worker threads; 0: one per core."""

    @property
    def own_metrics_port(self) -> int | None:
        """The port this process serves /metrics on besides the API port."""
        if self.metrics_port is None:
            return None
        return self.metrics_port + self.process_index

    @property
    def process_admission_headroom(self) -> float:
        """This process's share of each decode instance's KV budget: the processes admit
        independently, so each holds 1/processes of it and together they never
        over-admit."""
        return self.admission_headroom / self.processes


def settings_from_cluster(cluster: ClusterConfig) -> RouterSettings:
    """The router's view of a validated cluster.yaml.

    A policy cluster.yaml allows but this router does not implement yet (kv_aware,
    session) falls back to round_robin with a warning, so the default config serves.
    """
    r = cluster.router
    policy: str = r.policy
    if policy not in policy_names():
        log.warning(
            "routing policy %r is not implemented yet; using %r (implemented: %s)",
            policy,
            FALLBACK_POLICY,
            ", ".join(policy_names()),
        )
        policy = FALLBACK_POLICY
    api_key = r.api_key
    if api_key is None and r.api_key_env:
        api_key = os.environ.get(r.api_key_env) or None
        if api_key is None:
            raise ValueError(
                f"router.api_key_env names {r.api_key_env!r} but that environment variable "
                "is unset or empty; set it or remove api_key_env"
            )
    pool_of, capacity = _pools(cluster)
    adm = r.admission
    return RouterSettings(
        model=cluster.model,
        served_model_name=r.served_model_name,
        host=cluster.router_bind_host,
        port=r.port,
        policy=policy,
        api_key=api_key,
        max_input_tokens=r.max_input_tokens,
        request_timeout_s=r.request_timeout_s,
        health_interval_s=(
            max(1.0, r.health_timeout_s) if r.health_interval_s is None else r.health_interval_s
        ),
        health_timeout_s=r.health_timeout_s,
        metrics_port=r.metrics_port,
        processes=r.processes,
        prefill=tuple(
            InstanceEndpoint(name=p.name, url=cluster.instance_url(p), pool=pool_of[p.name])
            for p in cluster.prefill
        ),
        decode=tuple(
            InstanceEndpoint(name=d.name, url=cluster.instance_url(d)) for d in cluster.decode
        ),
        unified=tuple(
            InstanceEndpoint(name=u.name, url=cluster.instance_url(u), pool=pool_of[u.name])
            for u in cluster.unified
        ),
        block_size=cluster.cache.block_size,
        pool_capacity_bytes=capacity,
        admission_wait_timeout_s=adm.wait_timeout_s,
        admission_headroom=adm.headroom,
        admission_max_waiting=adm.max_waiting,
        admission_order=adm.order,
        admission_pass_bound_s=adm.pass_bound_s,
        max_output_tokens=adm.max_output_tokens,
        tool_parser=r.tool_parser,
        data_plane=r.data_plane,
        edge_threads=r.edge_threads,
    )


def _pools(cluster: ClusterConfig) -> tuple[dict[str, str | None], dict[str, int]]:
    """Which pool each prefill (or unified) instance uses, and each pool's DRAM.

    Shared pool: one, "shared", over every store. Split pool (`pool.shared: false`): one
    per node, "node:<name>", over that node's stores. No pool (absent or disabled): None.
    """
    pool = cluster.pool
    savers: tuple[PoolInstance, ...] = (*cluster.prefill, *cluster.unified)
    if pool is None or not pool.enabled:
        return {p.name: None for p in savers}, {}
    if pool.shared:
        return {p.name: "shared" for p in savers}, {"shared": sum(int(s.size) for s in pool.stores)}
    capacity: dict[str, int] = {}
    for s in pool.stores:
        capacity[f"node:{s.node}"] = capacity.get(f"node:{s.node}", 0) + int(s.size)
    return {p.name: f"node:{p.node}" for p in savers}, capacity

"""The cluster-wide sections of cluster.yaml: KV cache granularity, nodes, the pool,
the router and where the cluster secret comes from (protocol/cluster.py composes them with
the instances of protocol/cluster_instances.py into a ClusterConfig). Torch-free."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.cluster_types import (
    ByteSize,
    Fraction,
    Name,
    NonNegativeInt,
    Port,
    PositiveInt,
    Seconds,
    Section,
)

Protocol = Literal["tcp", "rdma"]
RoutingPolicy = Literal["round_robin", "random", "session", "kv_aware"]
ToolParserName = Literal["hermes", "llama3_json", "mistral"]
DataPlane = Literal["python", "native"]


class CacheConfig(Section, frozen=True, kw_only=True):
    """KV cache granularity shared by every instance (part of the KV namespace)."""

    block_size: PositiveInt = 16
    """Tokens per paged-KV block (GPU prefix-cache unit)."""
    chunk_size: PositiveInt = 256
    """Tokens per pool chunk; a multiple of block_size."""
    weights_cache_dir: str | None = None
    """Where converted weights are cached on every node; None: ~/.cache/kvserve."""
    prefill_order: Literal["shortest", "fcfs"] = "shortest"
    """Which prefills get an engine step's token budget first (engine/prefill_order.py):
    "shortest": the fewest tokens left to compute first (a short turn does not wait
    behind a long prompt's whole prefill), a request past prefill_bound_steps first;
    "fcfs": admission order. Every engine of the cluster (prefill, decode, unified)."""
    prefill_bound_steps: PositiveInt = 64
    """shortest: engine steps after its arrival from which a request goes before every
    other (oldest first): the longest a prompt is passed over."""
    prefill_admission: Literal["whole_prompt", "chunk"] = "whole_prompt"
    """When a prefill instance admits a waiting prompt (engine/admission.py):
    "whole_prompt": only when its whole prompt (after its prefix hit) fits the free KV
    blocks beside what the running prompts still need, so a burst larger than the cache
    waits instead of being preempted and computed twice; "chunk": when the blocks of its
    first chunk are free (later shortages preempt the latest admitted). Decode and unified
    instances always admit by chunk: their rows grow as they generate."""


class NodeConfig(Section, frozen=True, kw_only=True):
    """One machine (or one address of a machine) that runs components."""

    name: Name
    host: str
    """Address its components bind and advertise to the others (127.0.0.1 on one host).
    Never a wildcard: it is what peers connect to."""
    gpu_memory: ByteSize | None = None
    """Memory of each GPU of this node, for the budget check (protocol/device_budget.py);
    None: `kvserve check` / `up` probe it on the machine (nvidia-smi)."""
    share_devices: bool = False
    """Allow several instances on one GPU of this node (e.g. prefill and decode on GPU 0).
    Their GPU memory budgets must then fit the GPU together."""


class PoolMasterConfig(Section, frozen=True, kw_only=True):
    """The Mooncake Master of the pool (one per cluster, or one per node when split)."""

    node: str
    """Node that runs the master."""
    port: Port = 50051
    """RPC port of the master (clients and store services connect here)."""
    metrics_port: Port = 9003
    """Prometheus / admin HTTP port of the master."""
    eviction_high_watermark: Fraction = 0.9
    """Pool fullness at which LRU eviction starts."""
    eviction_ratio: Fraction = 0.05
    """Fraction of objects one eviction pass removes."""
    lease_ttl_s: Seconds = 10.0
    """Read lease an existence check grants (blocks eviction of what is being loaded)."""
    client_ttl_s: Seconds = 10.0
    """Heartbeat timeout after which a dead store's memory leaves the pool."""


class PoolStoreConfig(Section, frozen=True, kw_only=True):
    """One Store service: host DRAM contributed to the pool (one per NUMA node)."""

    node: str
    numa_node: NonNegativeInt | None = None
    """NUMA node to bind CPU and memory to (numactl); None: no binding. Required, and
    distinct, when a node runs several stores."""
    size: ByteSize
    """DRAM this store contributes, e.g. "64GiB"."""
    hugepages: bool = False
    """Back the segment with reserved huge pages (needed for large RDMA registrations)."""
    port: Port | None = None
    """Port of the store's Mooncake client (its segment name host:port); None: chosen by
    Mooncake at start."""
    metrics_port: Port | None = None
    """HTTP /health and /metrics port of the store service; None: a free port of the
    node's host, picked by `kvserve up`."""
    rdma_devices: tuple[str, ...] = ()
    """RDMA NICs of this store's NUMA node (protocol rdma only); empty: all."""
    prefill: Name | None = None
    """Mount this store's segment inside that prefill instance's process(es) instead of
    running a store service: the instance's own saves land in it and its restores of them
    are a local memcpy (no transfer through another process; docs/pool.md "Segments in
    prefill"). The instance must be on `node`; with PP each stage process mounts
    size / pipeline_parallel. The segment is still the whole pool's, and dies with the
    process like a store's. numa_node, port and metrics_port do not apply."""


class PoolConfig(Section, frozen=True, kw_only=True):
    """The shared KV pool in host DRAM (Mooncake Master + Store services)."""

    enabled: bool = True
    """False: the section is validated but no pool runs; prefill recomputes history."""
    shared: bool = True
    """True: one pool over every node. False: one pool per node (every node with a store
    runs its own master on master.port), the reference's "split pool" for comparison."""
    protocol: Protocol = "tcp"
    """Transport between clients and stores."""
    master: PoolMasterConfig
    stores: tuple[PoolStoreConfig, ...] = ()
    save_queue_depth: PositiveInt = 64
    """Chunks a prefill instance may have packed and being written (save slots, within
    pool_buffer_memory); beyond it computed chunks wait in the GPU prefix cache, never
    stalling compute (docs/pool.md step 4)."""
    save: Literal["through", "victim"] = "through"
    """When a computed prompt chunk is saved. "through": as soon as a save slot is free
    after it is computed. "victim": when the GPU prefix cache evicts it (the pool then
    holds what the GPU cache does not; a chunk evicted with no free save slot is lost)."""
    retention: Literal["mooncake", "client"] = "mooncake"
    """Who chooses what leaves a full pool. "mooncake": the master evicts past its high
    watermark (close to random for large chunk objects: a hole anywhere in a session's
    chain loses the rest of it). "client": each prefill or unified instance keeps the
    chunks it saved within its share of `retention_budget` of the pool's stores and removes
    the least recently used sessions' chains itself, tail first, so a kept chain stays a
    usable prefix (kvpool/retention.py; docs/pool.md "Retention")."""
    retention_budget: Annotated[float, msgspec.Meta(gt=0, le=0.9)] = 0.85
    """retention "client": the fraction of the stores' bytes the writing instances may
    fill together (split evenly among the instances that save to that pool); at most the
    master's high watermark (0.9), so that the master itself never evicts."""


class AdmissionConfig(Section, frozen=True, kw_only=True):
    """The router's admission gate in front of decode KV."""

    wait_timeout_s: Seconds = 30.0
    """Longest a request queues for KV headroom before a 429 with Retry-After."""
    headroom: Fraction = 0.9
    """Fraction of each decode instance's KV token budget the gate hands out."""
    max_waiting: PositiveInt = 1024
    """Requests queued at once; beyond it new requests are rejected at once."""
    order: Literal["fifo", "fits_first"] = "fifo"
    """Who goes first when decode KV frees (router/admission_order.py): "fifo": arrival
    order, a large request at the head holds back smaller ones that would fit; "fits_first":
    the first waiter in arrival order that fits goes, passing the head until the head has
    waited pass_bound_s (then arrival order until it is admitted)."""
    pass_bound_s: Seconds = 1.0
    """fits_first: the longest the head of the line is passed over."""
    max_output_tokens: PositiveInt | None = None
    """Longest completion a request may ask for (also caps the default max_tokens); None:
    what the context leaves. The input limit is router.max_input_tokens."""


class RouterConfig(Section, frozen=True, kw_only=True):
    """The OpenAI-compatible HTTP front end."""

    node: str | None = None
    """Node that runs the router; None: the first node."""
    host: str | None = None
    """Address the public API binds; None: the router node's host. "0.0.0.0" exposes it on
    every interface (then set an api_key)."""
    port: Port = 8000
    policy: RoutingPolicy = "kv_aware"
    """Routing of requests to prefill and decode instances."""
    api_key: str | None = None
    """Bearer token clients must send; None: no authentication."""
    api_key_env: str | None = None
    """Name of an environment variable holding the key (keeps it out of the file)."""
    served_model_name: str | None = None
    """Model name clients use; None: derived from `model`."""
    max_input_tokens: PositiveInt | None = None
    """Longest prompt accepted; None: the model's context length."""
    request_timeout_s: Seconds = 600.0
    """End-to-end limit of one request."""
    health_interval_s: Seconds | None = None
    """Period of the router's GET /health poll of every instance: how soon it notices an
    instance that died while idle, or one that answers again. At least health_timeout_s
    (a poll may last that long, so a shorter period would only poll back to back); None:
    1 s, or health_timeout_s where that is longer."""
    health_timeout_s: Seconds = 1.0
    """Longest one GET /health poll of an instance waits for its answer (polled every
    health_interval_s): one timed-out poll stops routing to the instance, three in a row
    mark it down (docs/router.md)."""
    admission: AdmissionConfig = AdmissionConfig()
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`. With `processes` > 1, process
    i serves its own metrics on metrics_port + i."""
    processes: PositiveInt = 1
    """Router processes sharing `port` (SO_REUSEPORT: the kernel spreads connections over
    them), each a full router; above 1 it needs `metrics_port`. Each admits against
    1/processes of every decode instance's KV budget (docs/router.md)."""
    tool_parser: ToolParserName | None = None
    """Format of the model's tool calls (docs/router.md); None: read from the chat template."""
    data_plane: DataPlane = "python"
    """Who serves `port`: "python": the router itself; "native": kvserve-edge (edge/, a
    Rust process the router starts) serves plain completions and chat natively and passes
    everything else to the router, which stays the control plane (docs/edge.md). native
    needs processes 1 and a built edge (scripts/setup.sh builds it)."""
    edge_threads: NonNegativeInt = 0
    """data_plane native: the edge's worker threads; 0: one per core."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment for the router process."""


class AuthConfig(Section, frozen=True, kw_only=True):
    """Where the cluster secret comes from (protocol/internal_auth.py): every internal
    call carries it and landing capabilities are keyed by it. Neither set: `kvserve up`
    creates a random one per run in the run directory (one host only); a cluster
    spanning several hosts must name one that every host shares."""

    secret_file: str | None = None
    """A file holding the secret (one line, at least 32 characters, mode 0600)."""
    secret_env: str | None = None
    """An environment variable holding the secret, set on every host."""

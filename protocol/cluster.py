"""cluster.yaml: the one configuration file of a kvserve deployment.

Every component loads the whole file with `load_cluster` and picks its own section
(`cluster.prefill_instance(name)`, `cluster.router`, ...), so all of them read the same
definitions. Every struct is frozen and rejects unknown keys; `ClusterConfig` checks the
cross-references (nodes, names, ports, devices, parallel layouts) when it is built, so a
`ClusterConfig` that exists is valid. Errors are `ConfigError`s naming the key path:

    decode[0].decode_context_parallel: 3 does not divide tensor_parallel 4; valid: 1, 2, 4

Sizes accept "512MiB"/"1GiB"/integers (cluster_types.ByteSize). Torch-free.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from protocol.cluster_checks import check_cluster
from protocol.cluster_types import (
    ByteSize,
    Device,
    Fraction,
    Name,
    NonNegativeInt,
    Port,
    PositiveInt,
    Seconds,
    dec_hook,
    device_name,
)
from protocol.config_errors import ConfigError
from protocol.config_paths import translate_validation_error

Dtype = Literal["float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8_e4m3"]
Protocol = Literal["tcp", "rdma"]
HandoffProtocol = Literal["tcp", "rdma", "cuda_ipc"]
AttentionBackendName = Literal["auto", "torch", "cpu", "flex"]
RoutingPolicy = Literal["round_robin", "random", "session", "kv_aware"]
ToolParserName = Literal["hermes", "llama3_json", "mistral"]
LogLevel = Literal["debug", "info", "warning", "error"]
MiB = 1024**2


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every cluster.yaml section: immutable, unknown keys are errors."""


class CacheConfig(_Section, frozen=True, kw_only=True):
    """KV cache granularity shared by every instance (part of the KV namespace)."""

    block_size: PositiveInt = 16
    """Tokens per paged-KV block (GPU prefix-cache unit)."""
    chunk_size: PositiveInt = 256
    """Tokens per pool chunk; a multiple of block_size."""
    weights_cache_dir: str | None = None
    """Where converted weights are cached on every node; None: ~/.cache/kvserve."""


class NodeConfig(_Section, frozen=True, kw_only=True):
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


class PoolMasterConfig(_Section, frozen=True, kw_only=True):
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


class PoolStoreConfig(_Section, frozen=True, kw_only=True):
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


class PoolConfig(_Section, frozen=True, kw_only=True):
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


class HandoffFaultsConfig(_Section, frozen=True, kw_only=True):
    """Injected handoff faults, for tests of the failure paths only (transfer/faults.py):
    never set them in a real deployment."""

    fail_prompt_tokens: PositiveInt | None = None
    """Fail the KV writes of every request with exactly this many prompt tokens, after
    its first piece (a transfer failed mid-flight)."""
    write_delay_s: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.0
    """Sleep before every KV write (a slow transport)."""
    hold_prompt_tokens: PositiveInt | None = None
    """Hold every request with exactly this many prompt tokens at prefill's door (before
    its engine) until `hold_until_file` exists (at most 300 s): a request queued in
    prefill while its decode dies."""
    hold_until_file: str | None = None


class EngineFaultsConfig(_Section, frozen=True, kw_only=True):
    """Injected per-request engine faults, for tests of a failing request only
    (engine/faults.py): never set them in a real deployment."""

    fail_seed: int
    """Every step holding a request with this sampling seed fails at `place`."""
    place: Literal["sample", "forward"] = "sample"
    """"sample": the batched sampler raises; "forward": the batched model forward raises."""
    stage: int | None = None
    """"forward" on a prefill pipeline: the one stage whose forward raises (None: each)."""
    rank: int | None = None
    """"forward" on a decode TP x DCP instance: the one rank that raises, inside its
    forward before layer `layer` (the others do not: a failure of that rank's device or
    memory); None: every rank alike, before the forward (what a request's input does)."""
    layer: int = 0


class PrefillConfig(_Section, frozen=True, kw_only=True):
    """One prefill instance: PP stages, one process per device."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """One device per pipeline stage: GPU indices [0, 1, 2, 3], "cuda:N", or "cpu"."""
    pipeline_parallel: PositiveInt = 1
    layer_split: tuple[PositiveInt, ...] | None = None
    """Layers per stage, e.g. [20, 20, 20, 18]; None: as even as possible. Length must be
    pipeline_parallel; the sum must equal the model's layer count (checked at start)."""
    max_batched_tokens: PositiveInt = 2048
    """Token budget of one forward step (chunked prefill)."""
    max_num_seqs: PositiveInt = 256
    """Requests scheduled at once."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache per device (GPU prefix cache)."""
    pool_buffer_memory: ByteSize = ByteSize(256 * MiB)
    """Buffer per device registered with the pool for zero-copy save/restore (pool only;
    pinned host memory, not part of the GPU budget)."""
    gpu_memory_budget: ByteSize | None = None
    """GPU memory one stage process may use; None: derived (weights + kv_cache_memory +
    handoff staging + workspace, protocol/device_budget.py). Checked when GPUs are shared."""
    dist_port: Port | None = None
    """torch.distributed rendezvous port of the stage processes; None: picked at start."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = {}
    """Extra environment for the instance's processes (e.g. NCCL_DEBUG)."""
    handoff_faults: HandoffFaultsConfig | None = None
    """Test-only fault injection into this instance's KV handoff (None: off)."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        """Torch device strings, one per stage."""
        return tuple(device_name(d) or str(d) for d in self.devices)


class TransferConfig(_Section, frozen=True, kw_only=True):
    """How KV reaches a decode instance from prefill (the handoff)."""

    protocol: HandoffProtocol = "tcp"
    """Mooncake Transfer Engine over "tcp" or "rdma" (any hosts), or "cuda_ipc": GPU to GPU
    between processes of one host (every prefill and this decode on GPUs of its node; the
    landing buffer lives on the decode GPU)."""
    port: Port | None = None
    """Transfer engine port of rank 0 (rank r uses port + r); None: picked at start."""
    rdma_devices: tuple[str, ...] = ()
    """RDMA NICs to use (protocol rdma only); empty: all."""


class DecodeConfig(_Section, frozen=True, kw_only=True):
    """One decode instance: tensor_parallel ranks, one process per device."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """One device per TP rank."""
    tensor_parallel: PositiveInt = 1
    decode_context_parallel: PositiveInt = 1
    """Ranks a head group's tokens are striped over (t mod DCP); must divide
    tensor_parallel."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache per device."""
    landing_memory: ByteSize = ByteSize(256 * MiB)
    """Registered buffer per device that handoff writes land in before the scatter. A
    request's region is at most a quarter of it (transfer/landing.py): longer prompts
    stream through the region as a ring, so any context length is served."""
    transfer: TransferConfig = TransferConfig()
    gpu_memory_budget: ByteSize | None = None
    """GPU memory one rank process may use; None: derived (weights + kv_cache_memory +
    landing_memory when it is on the GPU + workspace, protocol/device_budget.py)."""
    max_num_seqs: PositiveInt = 256
    """Requests decoded at once (continuous batching)."""
    dist_port: Port | None = None
    """torch.distributed rendezvous port of the rank processes; None: picked at start."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = {}
    """Extra environment for the instance's processes."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        """Torch device strings, one per rank."""
        return tuple(device_name(d) or str(d) for d in self.devices)


class UnifiedConfig(_Section, frozen=True, kw_only=True):
    """One unified instance: a single engine process that prefills and decodes (chunked
    prefill and decodes mixed in one step, as one vLLM server does), with no handoff. It
    restores history from the pool and saves every full chunk to it exactly as a prefill
    instance does; the router sends it a request in one call. The topology for a small
    box, where a second process would compete for the same cores (docs/architecture.md,
    "Topologies"). One device; pipeline and tensor parallel layouts are P/D only."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """Exactly one device: a GPU index, "cuda:N", or "cpu"."""
    max_batched_tokens: PositiveInt = 2048
    """Token budget of one forward step: decodes first, prefill chunks fill the rest."""
    max_num_seqs: PositiveInt = 256
    """Requests scheduled at once (prefilling and decoding together)."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache of the device: the prefix cache and every running request's KV."""
    pool_buffer_memory: ByteSize = ByteSize(256 * MiB)
    """Buffer registered with the pool for zero-copy save/restore (pool only)."""
    gpu_memory_budget: ByteSize | None = None
    """GPU memory the process may use; None: derived (weights + kv_cache_memory +
    workspace, protocol/device_budget.py). Checked when GPUs are shared."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = {}
    """Extra environment for the instance's process."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(device_name(d) or str(d) for d in self.devices)

    # What the prefill worker's pool pieces read of an instance (one stage, whole model).
    @property
    def pipeline_parallel(self) -> int:
        return 1

    @property
    def layer_split(self) -> tuple[int, ...] | None:
        return None

    @property
    def dist_port(self) -> int | None:
        return None


class AdmissionConfig(_Section, frozen=True, kw_only=True):
    """The router's admission gate in front of decode KV."""

    wait_timeout_s: Seconds = 30.0
    """Longest a request queues for KV headroom before a 429 with Retry-After."""
    headroom: Fraction = 0.9
    """Fraction of each decode instance's KV token budget the gate hands out."""
    max_waiting: PositiveInt = 1024
    """Requests queued at once; beyond it new requests are rejected at once."""
    max_output_tokens: PositiveInt | None = None
    """Longest completion a request may ask for (also caps the default max_tokens); None:
    what the context leaves. The input limit is router.max_input_tokens."""


class RouterConfig(_Section, frozen=True, kw_only=True):
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
    admission: AdmissionConfig = AdmissionConfig()
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    tool_parser: ToolParserName | None = None
    """Format of the model's tool calls (docs/router.md); None: read from the chat template."""
    env: dict[str, str] = {}
    """Extra environment for the router process."""


Instance = PrefillConfig | DecodeConfig | UnifiedConfig
PoolInstance = PrefillConfig | UnifiedConfig
"""An instance that restores from and saves to the pool (prefill and unified)."""


class AuthConfig(_Section, frozen=True, kw_only=True):
    """Where the cluster secret comes from (protocol/internal_auth.py): every internal
    call carries it and landing capabilities are keyed by it. Neither set: `kvserve up`
    creates a random one per run in the run directory (one host only); a cluster
    spanning several hosts must name one that every host shares."""

    secret_file: str | None = None
    """A file holding the secret (one line, at least 32 characters, mode 0600)."""
    secret_env: str | None = None
    """An environment variable holding the secret, set on every host."""


class ClusterConfig(_Section, frozen=True, kw_only=True):
    """A whole deployment: model, nodes, pool, instances, router. Valid once built."""

    name: Name
    """Cluster name (names the run directory and state file)."""
    model: str
    """HF model folder, a .gguf file, or builtin:smollm2-135m-instruct (same path on
    every node)."""
    dtype: Dtype = "bfloat16"
    """Weight and activation dtype (float32 for CPU correctness runs)."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """KV cache format of every instance (prefill, decode, pool objects and handoff carry
    it): "auto" stores `dtype`; "fp8_e4m3" stores float8 e4m3 values with a float32 scale
    per token and KV head, about half the bytes of bfloat16 (docs/kv_cache.md)."""
    attention_backend: AttentionBackendName = "auto"
    """Attention kernels of every engine process: "flex" (paged FlexAttention decode and
    flash prefill, CUDA only, with decode CUDA graphs), "cpu" (decode reads the paged
    cache in place with a C kernel built at start-up, prefill as the reference; CPU only,
    needs a C compiler, else it runs the reference), "torch" (the reference backend, CPU
    and CUDA), or "auto": flex on GPUs, cpu on CPUs."""
    cpu_pinning: bool = True
    """CPU engine processes of a node each pinned to their own slice of its CPUs, with
    one torch thread per CPU of the slice (enginehost/cpu_plan.py); false: not pinned,
    cpus // processes threads each."""
    log_level: LogLevel = "info"
    cache: CacheConfig = CacheConfig()
    nodes: tuple[NodeConfig, ...]
    pool: PoolConfig | None = None
    prefill: tuple[PrefillConfig, ...] = ()
    decode: tuple[DecodeConfig, ...] = ()
    unified: tuple[UnifiedConfig, ...] = ()
    """Instances that prefill and decode in one engine. A cluster serves through either
    prefill + decode instances (disaggregated) or unified instances, not both."""
    router: RouterConfig = RouterConfig()
    auth: AuthConfig = AuthConfig()

    def __post_init__(self) -> None:
        check_cluster(self)

    # -- lookups ------------------------------------------------------------------------

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError("", f"no node named {name!r}; nodes: {_names(self.nodes)}")

    def prefill_instance(self, name: str) -> PrefillConfig:
        """The prefill instance `name` (what `--name` of a prefill worker selects)."""
        for p in self.prefill:
            if p.name == name:
                return p
        raise ConfigError(
            "", f"no prefill instance named {name!r}; prefill: {_names(self.prefill)}"
        )

    def decode_instance(self, name: str) -> DecodeConfig:
        """The decode instance `name` (what `--name` of a decode worker selects)."""
        for d in self.decode:
            if d.name == name:
                return d
        raise ConfigError("", f"no decode instance named {name!r}; decode: {_names(self.decode)}")

    def unified_instance(self, name: str) -> UnifiedConfig:
        """The unified instance `name` (what `--name` of a unified worker selects)."""
        for u in self.unified:
            if u.name == name:
                return u
        raise ConfigError(
            "", f"no unified instance named {name!r}; unified: {_names(self.unified)}"
        )

    @property
    def disaggregated(self) -> bool:
        """True: prefill + decode instances with the KV handoff; False: unified ones."""
        return not self.unified

    def instance(self, name: str) -> Instance:
        instances: tuple[Instance, ...] = (*self.prefill, *self.decode, *self.unified)
        for inst in instances:
            if inst.name == name:
                return inst
        names = _names(instances)
        raise ConfigError("", f"no instance named {name!r}; instances: {names}")

    @property
    def pool_enabled(self) -> bool:
        return self.pool is not None and self.pool.enabled

    @property
    def router_node(self) -> NodeConfig:
        return self.node(self.router.node) if self.router.node else self.nodes[0]

    @property
    def router_bind_host(self) -> str:
        return self.router.host or self.router_node.host

    def instance_url(self, inst: Instance) -> str:
        """Base URL other components reach an instance at: http://host:port."""
        return f"http://{_url_host(self.node(inst.node).host)}:{inst.port}"

    @property
    def router_url(self) -> str:
        """Base URL of the router as reachable from its node (wildcards → node host)."""
        host = self.router_bind_host
        if host in ("0.0.0.0", "::", ""):
            host = self.router_node.host
        return f"http://{_url_host(host)}:{self.router.port}"

    @property
    def api_base_url(self) -> str:
        """The OpenAI base URL clients use: http://127.0.0.1:8000/v1."""
        return f"{self.router_url}/v1"


def _names(items: tuple[NodeConfig, ...] | tuple[Instance, ...]) -> str:
    return ", ".join(i.name for i in items) or "(none)"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- loading ----------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (YAML keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[object, object]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise ConfigError(
                "", f"key {key!r} given twice (line {key_node.start_mark.line + 1}); keep one"
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def parse_cluster(data: object, source: str | None = None) -> ClusterConfig:
    """Validate already-parsed YAML (a dict) into a ClusterConfig; ConfigError if invalid."""
    if not isinstance(data, dict):
        raise ConfigError(
            "", f"expected a mapping of keys at top level, got {type(data).__name__}", source
        )
    try:
        return msgspec.convert(data, ClusterConfig, dec_hook=dec_hook)
    except msgspec.ValidationError as e:
        raise translate_validation_error(e, ClusterConfig, data, source) from None
    except ConfigError as e:
        raise ConfigError(e.path, e.message, source) from None


def parse_cluster_yaml(text: str, source: str | None = None) -> ClusterConfig:
    """Parse and validate cluster.yaml text."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(e.path, e.message, source) from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"not valid YAML: {e}", source) from None
    return parse_cluster(data, source)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Load and validate a cluster.yaml file; ConfigError names the key path if invalid."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("", f"cannot read the cluster file: {e.strerror}", str(p)) from None
    return parse_cluster_yaml(text, str(p))


# -- which nodes are this machine -------------------------------------------------------


def is_local_host(host: str) -> bool:
    """True if `host` is a loopback address or an address of this machine.

    An address is this machine's if a socket can bind it; nothing is sent anywhere."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        addr = str(sockaddr[0])
        if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0, *sockaddr[2:]) if family == socket.AF_INET6 else (addr, 0))
            return True
        except OSError:
            continue
    return False


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_nodes(cluster: ClusterConfig) -> tuple[NodeConfig, ...]:
    """The nodes whose host is a loopback address or an address of this machine."""
    return tuple(n for n in cluster.nodes if is_local_host(n.host))

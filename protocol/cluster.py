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

from pathlib import Path
from typing import Literal

import msgspec
import yaml

from protocol.cluster_checks import check_cluster
from protocol.cluster_hosts import is_local_host, is_loopback_host, local_nodes
from protocol.cluster_instances import (
    DecodeConfig,
    EngineFaultsConfig,
    HandoffFaultsConfig,
    HandoffProtocol,
    Instance,
    PoolInstance,
    PrefillConfig,
    TransferConfig,
    UnifiedConfig,
)
from protocol.cluster_sections import (
    AdmissionConfig,
    AuthConfig,
    CacheConfig,
    NodeConfig,
    PoolConfig,
    PoolMasterConfig,
    PoolStoreConfig,
    Protocol,
    RouterConfig,
    RoutingPolicy,
    ToolParserName,
)
from protocol.cluster_types import Name, Seconds, Section, dec_hook
from protocol.config_errors import ConfigError
from protocol.config_paths import translate_validation_error

# The sections are defined beside this module (cluster_sections.py: cache, nodes, pool,
# router, auth; cluster_instances.py: prefill, decode, unified); every importer takes
# them from here, the one name of the schema.
__all__ = [
    "AdmissionConfig",
    "AttentionBackendName",
    "AuthConfig",
    "CacheConfig",
    "ClusterConfig",
    "DecodeConfig",
    "Dtype",
    "EngineFaultsConfig",
    "HandoffFaultsConfig",
    "HandoffProtocol",
    "Instance",
    "KVCacheDtype",
    "LogLevel",
    "NodeConfig",
    "PoolConfig",
    "PoolInstance",
    "PoolMasterConfig",
    "PoolStoreConfig",
    "PrefillConfig",
    "Protocol",
    "RouterConfig",
    "RoutingPolicy",
    "ToolParserName",
    "TransferConfig",
    "UnifiedConfig",
    "is_local_host",
    "is_loopback_host",
    "load_cluster",
    "local_nodes",
    "parse_cluster",
    "parse_cluster_yaml",
]

Dtype = Literal["float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8_e4m3"]
AttentionBackendName = Literal["auto", "torch", "cpu", "flex"]
LogLevel = Literal["debug", "info", "warning", "error"]


class ClusterConfig(Section, frozen=True, kw_only=True):
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
    engine_stall_timeout_s: Seconds | None = 120.0
    """How long one engine step (or one call into the engine) may run before its worker
    reports itself unhealthy on /health ("engine loop stalled"), fails its open requests
    with a 503 and the router routes around it, until a step completes again
    (enginehost/host.py). Above the slowest legitimate step (a first step that compiles
    kernels, a long prefill chunk on a CPU); None: never."""
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

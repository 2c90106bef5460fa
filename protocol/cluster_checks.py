"""Validation of cluster.yaml beyond types: references, names, devices, layouts, ports.
(Type errors become ConfigErrors in protocol/config_paths.py; the checks that need the
model's shape are protocol/cluster_model_checks.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from protocol.cluster_hosts import cluster_hosts
from protocol.cluster_types import device_name
from protocol.config_errors import ConfigError
from protocol.device_budget import shared_devices

if TYPE_CHECKING:
    from protocol.cluster import ClusterConfig, DecodeConfig, PrefillConfig, UnifiedConfig

_WILDCARDS = ("0.0.0.0", "::", "")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:%-]+$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED_NAMES = ("router", "launcher")
MIN_STORE_BYTES = 16 * 1024**2
"""Mooncake refuses smaller segments ("Total size must be at least 16777216")."""


def check_cluster(c: ClusterConfig) -> None:
    """Raise ConfigError for the first cross-field problem of a typed cluster config."""
    _check_model(c)
    if c.cache.chunk_size % c.cache.block_size:
        raise ConfigError(
            "cache.chunk_size",
            f"{c.cache.chunk_size} is not a multiple of block_size {c.cache.block_size}",
        )
    _check_nodes(c)
    _check_topology(c)
    seen: dict[str, str] = {}
    for path, inst in _instances(c):
        if inst.name in seen:
            raise ConfigError(f"{path}.name", f"{inst.name!r} is also {seen[inst.name]}.name")
        if inst.name in _RESERVED_NAMES or inst.name.startswith("pool-"):
            raise ConfigError(
                f"{path}.name",
                f"{inst.name!r} is reserved (router, launcher, pool-*); choose another name",
            )
        seen[inst.name] = path
        _check_ref(c, f"{path}.node", inst.node)
        _check_env(f"{path}.env", inst.env)
        for field in ("kv_cache_memory", "landing_memory", "landing_region", "pool_buffer_memory"):
            if getattr(inst, field, 1) == 0:
                raise ConfigError(f"{path}.{field}", "must be larger than 0")
    for i, p in enumerate(c.prefill):
        _check_prefill_layout(f"prefill[{i}]", p)
    for i, d in enumerate(c.decode):
        _check_decode_layout(f"decode[{i}]", d)
    for i, u in enumerate(c.unified):
        _check_devices(f"unified[{i}]", u.devices, 1, "one engine process")
    _check_gpu_sharing(c)
    _check_router(c)
    _check_auth(c)
    _check_pool(c)
    _check_ports(c)


def _check_topology(c: ClusterConfig) -> None:
    """Disaggregated (prefill + decode) or unified instances: one serving path."""
    if c.unified:
        if c.prefill or c.decode:
            section = "prefill" if c.prefill else "decode"
            raise ConfigError(
                section,
                "a cluster serves through unified instances or through prefill + decode "
                "instances, not both; remove one of them",
            )
        return
    if not c.prefill:
        raise ConfigError(
            "prefill",
            "at least one prefill instance is required (or unified instances instead of "
            "prefill + decode)",
        )
    if not c.decode:
        raise ConfigError("decode", "at least one decode instance is required")


def _instances(
    c: ClusterConfig,
) -> Iterator[tuple[str, PrefillConfig | DecodeConfig | UnifiedConfig]]:
    for i, p in enumerate(c.prefill):
        yield f"prefill[{i}]", p
    for i, d in enumerate(c.decode):
        yield f"decode[{i}]", d
    for i, u in enumerate(c.unified):
        yield f"unified[{i}]", u


def _check_model(c: ClusterConfig) -> None:
    if not c.model.strip():
        raise ConfigError("model", "must name an HF folder, a .gguf file or builtin:<name>")
    if c.model.startswith("builtin:") and not c.model[len("builtin:") :]:
        raise ConfigError("model", "builtin: needs a name, e.g. builtin:smollm2-135m-instruct")


def _check_nodes(c: ClusterConfig) -> None:
    if not c.nodes:
        raise ConfigError(
            "nodes", "at least one node is required, e.g. {name: local, host: 127.0.0.1}"
        )
    names: set[str] = set()
    for i, n in enumerate(c.nodes):
        if n.name in names:
            raise ConfigError(f"nodes[{i}].name", f"{n.name!r} is used by another node")
        names.add(n.name)
        if n.host in _WILDCARDS:
            raise ConfigError(
                f"nodes[{i}].host",
                f"{n.host!r} is a wildcard; give the address peers connect to (127.0.0.1 locally)",
            )
        if not _HOST_RE.match(n.host):
            raise ConfigError(f"nodes[{i}].host", f"{n.host!r} is not an IP address or host name")


def _check_ref(c: ClusterConfig, path: str, node: str) -> None:
    if all(n.name != node for n in c.nodes):
        valid = ", ".join(n.name for n in c.nodes)
        raise ConfigError(path, f"unknown node {node!r}; nodes: {valid}")


def _check_env(path: str, env: dict[str, str]) -> None:
    for key in env:
        if not _ENV_RE.match(key):
            raise ConfigError(f"{path}.{key}", "is not a valid environment variable name")


def _check_devices(path: str, devices: tuple[int | str, ...], num: int, what: str) -> None:
    if len(devices) != num:
        raise ConfigError(
            f"{path}.devices",
            f"lists {len(devices)} device(s) for {what}; give exactly one device per "
            f"{'stage' if 'pipeline' in what else 'rank'}",
        )
    names = []
    for j, dev in enumerate(devices):
        name = device_name(dev)
        if name is None:
            raise ConfigError(
                f"{path}.devices[{j}]", f"{dev!r} is not a device; valid: a GPU index, cuda:N, cpu"
            )
        if name != "cpu" and name in names:
            raise ConfigError(f"{path}.devices[{j}]", f"{name} is listed twice")
        names.append(name)
    if "cpu" in names and any(n != "cpu" for n in names):
        raise ConfigError(f"{path}.devices", "mixes cpu and GPUs; use one kind per instance")


def _check_prefill_layout(path: str, p: PrefillConfig) -> None:
    pp = p.pipeline_parallel
    _check_devices(path, p.devices, pp, f"pipeline_parallel {pp}")
    if p.layer_split is not None and len(p.layer_split) != pp:
        raise ConfigError(
            f"{path}.layer_split",
            f"has {len(p.layer_split)} entries for pipeline_parallel {pp}; give one layer "
            "count per stage, or null for an even split",
        )


def _check_decode_layout(path: str, d: DecodeConfig) -> None:
    tp, dcp = d.tensor_parallel, d.decode_context_parallel
    _check_devices(path, d.devices, tp, f"tensor_parallel {tp}")
    if tp % dcp:
        valid = ", ".join(str(k) for k in range(1, tp + 1) if tp % k == 0)
        raise ConfigError(
            f"{path}.decode_context_parallel",
            f"{dcp} does not divide tensor_parallel {tp}; valid: {valid}",
        )
    if dcp & (dcp - 1):
        raise ConfigError(
            f"{path}.decode_context_parallel",
            f"{dcp} is not a power of two: the scheduler's blocks hold block_size x "
            "decode_context_parallel tokens, a power of two",
        )
    if d.landing_region is not None and d.landing_region > d.landing_memory:
        raise ConfigError(
            f"{path}.landing_region",
            f"{d.landing_region} bytes is more than landing_memory ({d.landing_memory} "
            "bytes): a region is carved out of the landing buffer",
        )


def _check_gpu_sharing(c: ClusterConfig) -> None:
    """Instances share a GPU only where their node says share_devices: true (then
    protocol/device_budget.py checks that their budgets fit it, once the model is known);
    a handoff over cuda_ipc needs every instance on GPUs of one host."""
    for (host, name), paths in shared_devices(c).items():
        for path in paths:
            inst = _instance_at(c, path)
            node_i = next(k for k, n in enumerate(c.nodes) if n.name == inst.node)
            if not c.nodes[node_i].share_devices:
                raise ConfigError(
                    paths[1],
                    f"{name} on host {host} is already used by {paths[0]}: set "
                    f"nodes[{node_i}].share_devices: true to run several instances on one GPU "
                    "(their GPU memory budgets must then fit it), or give each its own GPU",
                )
    ipc = [i for i, d in enumerate(c.decode) if d.transfer.protocol == "cuda_ipc"]
    if not ipc:
        return
    first = f"decode[{ipc[0]}]"
    for j, d in enumerate(c.decode):
        if d.transfer.protocol != "cuda_ipc":
            raise ConfigError(
                f"decode[{j}].transfer.protocol",
                f"is {d.transfer.protocol} but {first} uses cuda_ipc: prefill has one handoff "
                "transport, so every decode instance must use the same protocol",
            )
    host = c.node(c.decode[ipc[0]].node).host
    for path, inst in _instances(c):
        if c.node(inst.node).host != host:
            raise ConfigError(
                f"{first}.transfer.protocol",
                f"cuda_ipc joins processes of one host, but {path} runs on "
                f"{c.node(inst.node).host} and {first} on {host}: use tcp or rdma",
            )
        if "cpu" in inst.device_names:
            raise ConfigError(
                f"{first}.transfer.protocol",
                f"cuda_ipc moves KV from GPU to GPU, but {path} runs on cpu: use tcp",
            )


def _instance_at(c: ClusterConfig, path: str) -> PrefillConfig | DecodeConfig | UnifiedConfig:
    """The instance of a key path such as decode[0].devices[1]."""
    kind, rest = path.split("[", 1)
    index = int(rest.split("]", 1)[0])
    if kind == "unified":
        return c.unified[index]
    return c.prefill[index] if kind == "prefill" else c.decode[index]


def _check_router(c: ClusterConfig) -> None:
    r = c.router
    if r.node is not None:
        _check_ref(c, "router.node", r.node)
    if r.host is not None and not _HOST_RE.match(r.host) and r.host not in _WILDCARDS:
        raise ConfigError("router.host", f"{r.host!r} is not an IP address or host name")
    if r.api_key is not None and r.api_key_env is not None:
        raise ConfigError("router.api_key_env", "give api_key or api_key_env, not both")
    if r.api_key is not None and not r.api_key.strip():
        raise ConfigError("router.api_key", "is empty; remove it or give a key")
    if r.api_key_env is not None and not _ENV_RE.match(r.api_key_env):
        raise ConfigError("router.api_key_env", "is not a valid environment variable name")
    if r.host in _WILDCARDS and r.api_key is None and r.api_key_env is None:
        raise ConfigError(
            "router.host",
            f"{r.host!r} opens the API on every interface, so it needs router.api_key or "
            "router.api_key_env; or bind the router node's address",
        )
    if r.data_plane == "native" and r.processes > 1:
        raise ConfigError(
            "router.processes",
            f"is {r.processes}, but router.data_plane native needs 1: the edge serves "
            "router.port on every core itself; set processes: 1 (or data_plane: python)",
        )
    if r.data_plane != "native" and r.edge_threads:
        raise ConfigError(
            "router.edge_threads",
            "sets the native data plane's threads, but router.data_plane is python; "
            "remove it or set data_plane: native",
        )
    if r.processes > 1 and r.metrics_port is None:
        raise ConfigError(
            "router.metrics_port",
            f"router.processes is {r.processes}: the processes share router.port, so /metrics "
            "there would answer for one of them at random; set metrics_port (process i serves "
            "its metrics on metrics_port + i)",
        )
    if r.health_interval_s is not None and r.health_interval_s < r.health_timeout_s:
        raise ConfigError(
            "router.health_interval_s",
            f"{r.health_interval_s:g} is below router.health_timeout_s "
            f"({r.health_timeout_s:g}): a poll may last the whole timeout, so the polls would "
            "run back to back; set health_interval_s >= health_timeout_s",
        )
    _check_env("router.env", r.env)


def _check_auth(c: ClusterConfig) -> None:
    a = c.auth
    if a.secret_file is not None and a.secret_env is not None:
        raise ConfigError("auth", "give secret_file or secret_env, not both")
    if a.secret_file is not None and not a.secret_file.strip():
        raise ConfigError("auth.secret_file", "is empty; name a file or remove it")
    if a.secret_env is not None and not _ENV_RE.match(a.secret_env):
        raise ConfigError("auth.secret_env", "is not a valid environment variable name")
    hosts = cluster_hosts(c)
    if len(hosts) > 1 and a.secret_file is None and a.secret_env is None:
        raise ConfigError(
            "auth",
            f"the cluster spans {len(hosts)} hosts ({', '.join(hosts)}): every host must "
            "share one cluster secret; set auth.secret_file or auth.secret_env",
        )


def _check_pool(c: ClusterConfig) -> None:
    pool = c.pool
    if pool is None:
        return
    _check_ref(c, "pool.master.node", pool.master.node)
    if pool.enabled and not pool.stores:
        raise ConfigError("pool.stores", "an enabled pool needs at least one store")
    per_node: dict[str, list[int]] = {}
    for i, s in enumerate(pool.stores):
        _check_ref(c, f"pool.stores[{i}].node", s.node)
        if s.size < MIN_STORE_BYTES:
            raise ConfigError(
                f"pool.stores[{i}].size",
                f"{s.size} bytes is below 16MiB, the smallest segment Mooncake mounts",
            )
        if s.prefill is not None:
            _check_store_in_prefill(c, i)
            continue
        per_node.setdefault(s.node, []).append(i)
    for node, idx in per_node.items():
        if len(idx) < 2:
            continue
        numas: set[int] = set()
        for i in idx:
            numa = pool.stores[i].numa_node
            if numa is None or numa in numas:
                raise ConfigError(
                    f"pool.stores[{i}].numa_node",
                    f"node {node} runs {len(idx)} stores; give each a distinct numa_node",
                )
            numas.add(numa)
    if pool.enabled and not pool.shared:
        store_nodes = {s.node for s in pool.stores}
        for path, p in _instances(c):
            if path.startswith("decode"):
                continue
            if p.node not in store_nodes:
                raise ConfigError(
                    f"{path}.node",
                    f"pool.shared is false but node {p.node} has no store; add one to pool.stores",
                )


def _check_store_in_prefill(c: ClusterConfig, i: int) -> None:
    """A store mounted in a prefill instance (pool.stores[i].prefill)."""
    assert c.pool is not None
    s = c.pool.stores[i]
    path = f"pool.stores[{i}]"
    inst = next((p for p in c.prefill if p.name == s.prefill), None)
    if inst is None:
        names = ", ".join(p.name for p in c.prefill)
        raise ConfigError(f"{path}.prefill", f"no prefill instance {s.prefill!r} (have: {names})")
    if inst.node != s.node:
        raise ConfigError(
            f"{path}.node",
            f"the store is mounted in prefill {inst.name!r}, which runs on node {inst.node}, "
            f"not {s.node}",
        )
    for field in ("numa_node", "port", "metrics_port"):
        if getattr(s, field) is not None:
            raise ConfigError(
                f"{path}.{field}",
                f"does not apply to a store mounted in prefill {inst.name!r} (it runs in the "
                "instance's processes, with their binding, ports and /metrics); remove it",
            )
    others = [j for j, o in enumerate(c.pool.stores) if o.prefill == s.prefill]
    if others[0] != i:
        raise ConfigError(
            f"{path}.prefill",
            f"pool.stores[{others[0]}] is already mounted in prefill {inst.name!r}; give the "
            "instance one store (its size is the instance's segment)",
        )
    per_stage = s.size // inst.pipeline_parallel
    if per_stage < MIN_STORE_BYTES:
        raise ConfigError(
            f"{path}.size",
            f"{s.size} bytes over {inst.pipeline_parallel} stage processes is {per_stage} "
            "bytes each, below 16MiB, the smallest segment Mooncake mounts",
        )


def cluster_ports(c: ClusterConfig) -> Iterator[tuple[str, str, int]]:
    """(host, key path, port) of every fixed port the cluster listens on."""
    r = c.router
    rhost = c.router_node.host
    yield rhost, "router.port", r.port
    if r.metrics_port is not None:
        yield rhost, "router.metrics_port", r.metrics_port
        for i in range(1, r.processes):
            yield rhost, f"router.metrics_port (+{i}, router process {i})", r.metrics_port + i
    for path, inst in _instances(c):
        host = c.node(inst.node).host
        yield host, f"{path}.port", inst.port
        for field in ("metrics_port", "dist_port"):
            if getattr(inst, field) is not None:
                yield host, f"{path}.{field}", getattr(inst, field)
    for i, d in enumerate(c.decode):
        if d.transfer.port is not None:
            host = c.node(d.node).host
            for rank in range(d.tensor_parallel):
                suffix = f" (rank {rank})" if rank else ""
                yield host, f"decode[{i}].transfer.port{suffix}", d.transfer.port + rank
    pool = c.pool
    if pool is None or not pool.enabled:
        return
    master_nodes = {pool.master.node} if pool.shared else {s.node for s in pool.stores}
    for node in sorted(master_nodes):
        host = c.node(node).host
        yield host, "pool.master.port", pool.master.port
        yield host, "pool.master.metrics_port", pool.master.metrics_port
    for i, s in enumerate(pool.stores):
        for field in ("port", "metrics_port"):
            if getattr(s, field) is not None:
                yield c.node(s.node).host, f"pool.stores[{i}].{field}", getattr(s, field)


MOONCAKE_RPC_PORTS = (15000, 17000)
"""Mooncake's default MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (inclusive): every Transfer Engine
(a pool store's, a worker's) binds its RPC port at random in it when it starts."""
MOONCAKE_STORE_CLIENT_PORTS = (12300, 14300)
"""Mooncake's default MC_STORE_CLIENT_MIN_PORT..MAX (inclusive): a pool client given a
host without a port (a prefill's or unified instance's pool client) binds one at random
in it when it starts."""
_MOONCAKE_RANGES = (
    (
        MOONCAKE_RPC_PORTS,
        ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"),
        "every Mooncake Transfer Engine (pool stores, workers) binds its RPC port",
    ),
    (
        MOONCAKE_STORE_CLIENT_PORTS,
        ("MC_STORE_CLIENT_MIN_PORT", "MC_STORE_CLIENT_MAX_PORT"),
        "every Mooncake pool client of an instance binds its transfer port",
    ),
)


def _check_ports(c: ClusterConfig) -> None:
    used: dict[tuple[str, int], str] = {}
    envs = [c.router.env, *(inst.env for _, inst in _instances(c))]
    ranges = [
        (low, high, who)
        for (low, high), names, who in _MOONCAKE_RANGES
        if not any(name in e for e in envs for name in names)  # moved: the user knows
    ]
    for host, path, port in cluster_ports(c):
        if port > 65535:
            raise ConfigError(path, f"port {port} is beyond 65535")
        for low, high, who in ranges:
            if low <= port <= high:
                raise ConfigError(
                    path,
                    f"port {port} is inside {low}-{high}, where {who} at random: one may "
                    "take it before this component starts; choose a port outside that range",
                )
        key = (host, port)
        if key in used:
            raise ConfigError(
                path,
                f"port {port} on host {host} is also {used[key]}; give each component its own port",
            )
        used[key] = path

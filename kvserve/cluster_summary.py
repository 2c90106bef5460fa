"""The human summary `kvserve check` prints of a valid cluster.yaml."""

from __future__ import annotations

from kvpool.topology import master_component, master_nodes, service_stores, store_component
from protocol.cluster import (
    ClusterConfig,
    DecodeConfig,
    Instance,
    PrefillConfig,
    UnifiedConfig,
    local_nodes,
)
from protocol.cluster_types import format_bytes


def _devices(inst: PrefillConfig | DecodeConfig | UnifiedConfig) -> str:
    names = inst.device_names
    if all(n == "cpu" for n in names):
        return "cpu" if len(names) == 1 else f"cpu x{len(names)}"
    return ",".join(n.removeprefix("cuda:") for n in names)


def summarize(c: ClusterConfig, source: str) -> str:
    """Multi-line summary: model, nodes, pool, instances, router, what runs here."""
    local = {n.name for n in local_nodes(c)}
    kv = "" if c.kv_cache_dtype == "auto" else f", KV cache {c.kv_cache_dtype}"
    lines = [
        f"cluster {c.name!r} is valid ({source})",
        f"  model    {c.model} ({c.dtype}{kv}); block {c.cache.block_size}, chunk "
        f"{c.cache.chunk_size} tokens",
    ]
    for n in c.nodes:
        here = "  (this machine)" if n.name in local else ""
        lines.append(f"  node     {n.name} {n.host}{here}")
    pool = c.pool
    if pool is None:
        lines.append("  pool     none")
    else:
        total = sum(s.size for s in pool.stores)
        state = "enabled" if pool.enabled else "disabled"
        mode = "shared" if pool.shared else "split per node"
        lines.append(
            f"  pool     {state}, {mode}, {pool.protocol}; master {pool.master.node}:"
            f"{pool.master.port}; {len(pool.stores)} store(s), {format_bytes(total)}"
            + "".join(
                f"; {format_bytes(st.size)} of it in {st.prefill}"
                for st in pool.stores
                if st.prefill is not None
            )
        )
    for p in c.prefill:
        split = f" split {list(p.layer_split)}" if p.layer_split else ""
        lines.append(
            f"  prefill  {p.name} on {p.node} {c.instance_url(p)}  devices {_devices(p)}  "
            f"PP{p.pipeline_parallel}{split}  kv {format_bytes(p.kv_cache_memory)}/device  "
            f"batch {p.max_batched_tokens} tokens"
        )
    for d in c.decode:
        lines.append(
            f"  decode   {d.name} on {d.node} {c.instance_url(d)}  devices {_devices(d)}  "
            f"TP{d.tensor_parallel} DCP{d.decode_context_parallel}  kv "
            f"{format_bytes(d.kv_cache_memory)}/device  landing "
            f"{format_bytes(d.landing_memory)}  transfer {d.transfer.protocol}"
        )
    for u in c.unified:
        lines.append(
            f"  unified  {u.name} on {u.node} {c.instance_url(u)}  devices {_devices(u)}  "
            f"prefill + decode in one engine  kv {format_bytes(u.kv_cache_memory)}  "
            f"batch {u.max_batched_tokens} tokens"
        )
    r = c.router
    auth = (
        "api key"
        if r.api_key
        else (f"api key from ${r.api_key_env}" if r.api_key_env else "no auth")
    )
    lines.append(
        f"  router   {c.api_base_url} on {c.router_node.name} (binds {c.router_bind_host}); "
        f"policy {r.policy}; {auth}"
        + (f"; {r.processes} processes" if r.processes > 1 else "")
        + ("; native data plane (kvserve-edge)" if r.data_plane == "native" else "")
    )
    instances: tuple[Instance, ...] = (*c.prefill, *c.decode, *c.unified)
    here_names = [i.name for i in instances if i.node in local]
    if c.router_node.name in local:
        here_names.insert(0, "router")
    if pool is not None and pool.enabled:
        stores = [store_component(i) for i, st in service_stores(c) if st.node in local]
        masters = [master_component(c, n) for n in master_nodes(c) if n in local]
        here_names = masters + stores + here_names
    here = ", ".join(here_names) or "nothing (no node is this machine)"
    lines.append(f"  here     {here}")
    return "\n".join(lines)

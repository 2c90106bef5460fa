"""GPU memory budgets: several instances on one GPU, opt-in and checked.

Each instance process on a GPU needs, per device:

    budget = weights (its layers; embeddings and LM head where they live)
           + kv_cache_memory
           + landing_memory (decode, when the landing is on the GPU: transfer.protocol
             cuda_ipc) or handoff staging (prefill: its staging slots live beside its KV)
           + workspace (activations of one step, logits, the CUDA context)

or the `gpu_memory_budget` the instance states. Sharing a GPU between instances is
refused unless the node says `share_devices: true`; then the budgets of everything on the
device must fit its memory (the node's `gpu_memory`, or what `kvserve check` / `up` probe
on the machine). Errors name the device and the instances:

    nodes[0] (gpu0) cuda:0 holds prefill[0] p0 (17.4GiB) + decode[0] d0 (33.0GiB) =
    50.4GiB, more than its 40GiB: lower kv_cache_memory / landing_memory, or give the
    instances separate GPUs

Torch-free: the model enters as its shape (modelinfo.config.ModelConfig has it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.cluster_model_checks import ModelShape
from protocol.cluster_types import device_name, format_bytes
from protocol.config_errors import ConfigError

if TYPE_CHECKING:
    from protocol.cluster import ClusterConfig, DecodeConfig, PrefillConfig, UnifiedConfig

MiB = 1024**2
GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

HANDOFF_STAGING_BYTES = 64 * MiB
"""A prefill stage's handoff staging slots (on its KV device) over Mooncake."""
CUDA_IPC_STAGING_BYTES = 1 * GiB
"""... over cuda_ipc: slots of 256 MiB, so one 2,048-token chunk of an 8B model is one
piece (each piece costs a gather, a write and a scatter of per-layer launches)."""
CUDA_CONTEXT_BYTES = 768 * MiB
"""The CUDA context, cuBLAS workspaces and allocator slack of one process."""


class ModelBytes(ModelShape, Protocol):
    """What a budget needs of the model (modelinfo.config.ModelConfig has it): its layout
    (ModelShape: layers and heads) and the sizes of its weights."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def mlp_params_per_layer(self) -> int:
        """Every expert counted for a mixture of experts; 3 x hidden x intermediate else."""
        ...


@dataclass(frozen=True)
class DeviceUse:
    """One instance process's share of one GPU."""

    path: str
    """Key path of the instance, e.g. decode[0]."""
    name: str
    node: str
    device: str
    """Torch device string, e.g. cuda:0."""
    budget_bytes: int
    parts: tuple[tuple[str, int], ...]
    """(what, bytes) the budget is made of; ("stated", n) for gpu_memory_budget."""

    def describe(self) -> str:
        return f"{self.path} {self.name} ({format_bytes(self.budget_bytes)})"


def handoff_staging_bytes(protocol: str) -> int:
    """A prefill stage's staging for a handoff over `protocol` (transfer.protocol)."""
    return CUDA_IPC_STAGING_BYTES if protocol == "cuda_ipc" else HANDOFF_STAGING_BYTES


def _layer_params(m: ModelBytes) -> int:
    # An MLA model's projections (low-rank q and kv) are not q/k/v heads: ModelConfig
    # counts them (attn_params_per_layer); a bare shape falls back to q/k/v/o heads.
    attn = getattr(m, "attn_params_per_layer", None)
    if attn is None:
        attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    return attn + m.mlp_params_per_layer + 2 * m.hidden_size


def _embed_params(m: ModelBytes) -> int:
    return m.vocab_size * m.hidden_size


def _workspace(m: ModelBytes, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """Activations of one step of num_tokens (a few hidden- and MLP-wide tensors, some
    in float32), the logits of num_seqs rows in float32, and the CUDA context."""
    acts = num_tokens * (4 * m.hidden_size + 3 * m.intermediate_size) * dtype_bytes * 2
    logits = min(num_seqs, num_tokens) * m.vocab_size * 4
    return acts + logits + CUDA_CONTEXT_BYTES


def _stage_layers(p: PrefillConfig, num_layers: int) -> list[int]:
    if p.layer_split is not None:
        return list(p.layer_split)
    pp = p.pipeline_parallel
    return [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]


def prefill_uses(
    c: ClusterConfig, i: int, m: ModelBytes, handoff_protocol: str
) -> Iterator[DeviceUse]:
    p = c.prefill[i]
    db = DTYPE_BYTES[c.dtype]
    layers = _stage_layers(p, m.num_layers)
    last = len(layers) - 1
    for s, (dev, n) in enumerate(zip(p.devices, layers, strict=False)):
        name = device_name(dev)
        if name is None or name == "cpu":
            continue
        if p.gpu_memory_budget is not None:
            stated = int(p.gpu_memory_budget)
            yield DeviceUse(f"prefill[{i}]", p.name, p.node, name, stated, (("stated", stated),))
            continue
        params = n * _layer_params(m)
        params += _embed_params(m) if s == 0 else 0
        params += _embed_params(m) if s == last and (s != 0 or not m.tie_word_embeddings) else 0
        parts = (
            ("weights", params * db),
            ("kv_cache_memory", int(p.kv_cache_memory)),
            ("handoff staging", handoff_staging_bytes(handoff_protocol)),
            ("workspace", _workspace(m, p.max_batched_tokens, p.max_num_seqs, db)),
        )
        yield DeviceUse(f"prefill[{i}]", p.name, p.node, name, sum(b for _, b in parts), parts)


def decode_uses(c: ClusterConfig, i: int, m: ModelBytes) -> Iterator[DeviceUse]:
    d = c.decode[i]
    db = DTYPE_BYTES[c.dtype]
    tp = d.tensor_parallel
    for dev in d.devices:
        name = device_name(dev)
        if name is None or name == "cpu":
            continue
        if d.gpu_memory_budget is not None:
            stated = int(d.gpu_memory_budget)
            yield DeviceUse(f"decode[{i}]", d.name, d.node, name, stated, (("stated", stated),))
            continue
        # layers split over TP ranks; embeddings and LM head counted whole (replicated)
        heads = 1 if m.tie_word_embeddings else 2
        params = m.num_layers * _layer_params(m) // tp + heads * _embed_params(m)
        landing = int(d.landing_memory) if d.transfer.protocol == "cuda_ipc" else 0
        parts = (
            ("weights", params * db),
            ("kv_cache_memory", int(d.kv_cache_memory)),
            ("landing_memory", landing),
            ("workspace", _workspace(m, d.max_num_seqs, d.max_num_seqs, db)),
        )
        yield DeviceUse(f"decode[{i}]", d.name, d.node, name, sum(b for _, b in parts), parts)


def unified_uses(c: ClusterConfig, i: int, m: ModelBytes) -> Iterator[DeviceUse]:
    """A unified instance's one process: the whole model, its KV, a step's workspace."""
    u = c.unified[i]
    name = device_name(u.devices[0])
    if name is None or name == "cpu":
        return
    if u.gpu_memory_budget is not None:
        stated = int(u.gpu_memory_budget)
        yield DeviceUse(f"unified[{i}]", u.name, u.node, name, stated, (("stated", stated),))
        return
    db = DTYPE_BYTES[c.dtype]
    heads = 1 if m.tie_word_embeddings else 2
    params = m.num_layers * _layer_params(m) + heads * _embed_params(m)
    parts = (
        ("weights", params * db),
        ("kv_cache_memory", int(u.kv_cache_memory)),
        ("workspace", _workspace(m, u.max_batched_tokens, u.max_num_seqs, db)),
    )
    yield DeviceUse(f"unified[{i}]", u.name, u.node, name, sum(b for _, b in parts), parts)


def device_uses(c: ClusterConfig, m: ModelBytes) -> list[DeviceUse]:
    """Every instance process's budget on every GPU it uses."""
    protocol = c.decode[0].transfer.protocol if c.decode else "tcp"
    uses: list[DeviceUse] = []
    for i in range(len(c.prefill)):
        uses += prefill_uses(c, i, m, protocol)
    for i in range(len(c.decode)):
        uses += decode_uses(c, i, m)
    for i in range(len(c.unified)):
        uses += unified_uses(c, i, m)
    return uses


def check_device_budgets(
    c: ClusterConfig, m: ModelBytes, probed: Mapping[str, Mapping[str, int]] | None = None
) -> list[str]:
    """ConfigError when the budgets on a GPU exceed its memory; returns one summary line
    per GPU in use. A GPU's memory is its node's `gpu_memory`, else `probed[node][device]`
    (what kvserve measured on that machine); a GPU with neither is listed as unchecked."""
    by_device: dict[tuple[str, str], list[DeviceUse]] = {}
    for u in device_uses(c, m):
        by_device.setdefault((u.node, u.device), []).append(u)
    lines = []
    for (node_name, device), uses in by_device.items():
        node_i = next(k for k, n in enumerate(c.nodes) if n.name == node_name)
        node = c.nodes[node_i]
        total = sum(u.budget_bytes for u in uses)
        held = " + ".join(u.describe() for u in uses)
        memory: int | None = node.gpu_memory
        if memory is None and probed is not None:
            memory = probed.get(node_name, {}).get(device)
        if memory is None:
            lines.append(f"  gpu      {node_name} {device}: {held} (memory unknown: not checked)")
            continue
        if total > memory:
            fix = (
                "lower kv_cache_memory / landing_memory / max_batched_tokens, or give the "
                "instances separate GPUs"
                if len(uses) > 1
                else "lower kv_cache_memory / max_batched_tokens, or use a larger GPU"
            )
            raise ConfigError(
                f"nodes[{node_i}]",
                f"{device} of node {node_name} holds {held} = {format_bytes(total)}, more "
                f"than its {format_bytes(int(memory))}: {fix}",
            )
        lines.append(
            f"  gpu      {node_name} {device}: {held} = {format_bytes(total)} of "
            f"{format_bytes(int(memory))}"
        )
    return lines


def shared_devices(c: ClusterConfig) -> dict[tuple[str, str], list[str]]:
    """(node, device) -> key paths of the instances on it, for GPUs used by several."""
    owners: dict[tuple[str, str], list[str]] = {}
    insts: list[tuple[str, PrefillConfig | DecodeConfig | UnifiedConfig]] = [
        *((f"prefill[{i}]", p) for i, p in enumerate(c.prefill)),
        *((f"decode[{i}]", d) for i, d in enumerate(c.decode)),
        *((f"unified[{i}]", u) for i, u in enumerate(c.unified)),
    ]
    for path, inst in insts:
        host = c.node(inst.node).host
        for j, dev in enumerate(inst.devices):
            name = device_name(dev)
            if name is None or name == "cpu":
                continue
            owners.setdefault((host, name), []).append(f"{path}.devices[{j}]")
    return {k: v for k, v in owners.items() if len(v) > 1}

"""Checks of cluster.yaml against the model it serves: prefill layer splits, decode TP x DCP
head layouts and landing buffers, and the KV bytes of one token on an instance. Run where
the model can be read (`kvserve check`, `kvserve up`, every worker at start); the checks of
the file alone are protocol/cluster_checks.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from protocol.config_errors import ConfigError
from protocol.kv_layout import kv_kind_parts, row_bytes
from protocol.parallel import (
    decode_rank_shards,
    head_layout_error,
    landing_error,
    layer_split_error,
)

if TYPE_CHECKING:
    from protocol.cluster import ClusterConfig, PrefillConfig, UnifiedConfig


class ModelShape(Protocol):
    """What the layout checks need of a model (modelinfo.config.ModelConfig has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...


def check_model_layouts(c: ClusterConfig, model: ModelShape, only: str | None = None) -> None:
    """ConfigError if a prefill layer split or a decode TP x DCP does not fit the model
    (only instance `only` when given). Run where the model can be read: `kvserve check`
    and `kvserve up`, and every worker at start."""
    for i, p in enumerate(c.prefill):
        if only is not None and p.name != only:
            continue
        if p.layer_split is not None:
            problem = layer_split_error(p.layer_split, model.num_layers)
            if problem is not None:
                raise ConfigError(f"prefill[{i}].layer_split", problem)
        elif p.pipeline_parallel > model.num_layers:
            raise ConfigError(
                f"prefill[{i}].pipeline_parallel",
                f"{p.pipeline_parallel} stages for a model of {model.num_layers} layers; "
                f"at most {model.num_layers}",
            )
    for i, d in enumerate(c.decode):
        if only is not None and d.name != only:
            continue
        problem = head_layout_error(
            model.num_heads, model.num_kv_heads, d.tensor_parallel, d.decode_context_parallel
        )
        if problem is not None:
            raise ConfigError(f"decode[{i}].tensor_parallel", problem)
        head_dim = getattr(model, "head_dim", None)
        if head_dim is None:
            continue  # a bare shape (layout checks only): no bytes to check
        problem = landing_error(
            int(d.landing_memory),
            rank_kv_bytes_per_token(
                c, model, head_dim, d.tensor_parallel, d.decode_context_parallel
            ),
            max((p.pipeline_parallel for p in c.prefill), default=1),
            int(getattr(model, "max_position_embeddings", 0)),
            None if d.landing_region is None else int(d.landing_region),
        )
        if problem is not None:
            field = "landing_region" if d.landing_region is not None else "landing_memory"
            raise ConfigError(f"decode[{i}].{field}", problem)


def rank_kv_bytes_per_token(
    c: ClusterConfig, model: ModelShape, head_dim: int, tp: int, dcp: int
) -> int:
    """KV bytes of one token (all layers; K and V, or the MLA latent, which every rank
    holds whole) on a decode rank holding the most heads, in the cluster's KV cache dtype
    (fp8 rows: head_dim + 4 bytes)."""
    shard = decode_rank_shards(model.num_heads, model.num_kv_heads, tp, dcp)[0]
    parts = kv_kind_parts(getattr(model, "kv_kind", "mha"))
    row = row_bytes(c.kv_cache_dtype, c.dtype, head_dim)
    return model.num_layers * parts * shard.num_kv_heads * row


def prefill_kv_bytes_per_token(
    c: ClusterConfig, model: ModelShape, head_dim: int, p: PrefillConfig | UnifiedConfig
) -> int:
    """KV bytes of one token (all parts) on the prefill stage holding the most layers (a
    unified instance: its one process, every layer)."""
    if p.layer_split is not None:
        layers = max(p.layer_split)
    else:
        layers = -(-model.num_layers // p.pipeline_parallel)
    parts = kv_kind_parts(getattr(model, "kv_kind", "mha"))
    heads = 1 if parts == 1 else model.num_kv_heads
    return layers * parts * heads * row_bytes(c.kv_cache_dtype, c.dtype, head_dim)

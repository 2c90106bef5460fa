"""What identifies an engine's KV: its dtype by name and the KV namespace (weights, KV
dtype, block and chunk sizes, layer split, RoPE) that decides which engines may share
cached KV."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from modelinfo.info import ModelInfo
from protocol.namespace import KVNamespace


def torch_dtype(name: str) -> torch.dtype:
    return {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "uint8": torch.uint8,
    }[name]


def rope_key(info: ModelInfo) -> str:
    c = info.config
    s = c.rope_scaling
    return (
        f"theta={c.rope_theta},kind={s.kind},f={s.factor},lo={s.low_freq_factor},"
        f"hi={s.high_freq_factor},orig={s.original_max_position_embeddings}"
    )


def kv_namespace(
    info: ModelInfo, config: EngineConfig, layer_split: tuple[int, ...]
) -> KVNamespace:
    """The namespace of an engine's KV (what may share cached KV with it): every process
    of an instance computes the same one."""
    return KVNamespace(
        weights_fingerprint=info.fingerprint,
        kv_dtype=config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        block_size=config.block_size,
        chunk_size=config.chunk_size,
        layer_split=layer_split,
        rope=rope_key(info),
    )

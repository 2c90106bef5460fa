"""The model of a one-process engine: its weights, attention backend and paged cache in
this process (engine/parallel/ builds the runners of PP and TP x DCP instances)."""

from __future__ import annotations

import torch

from engine.attention.base import get_backend
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.registry import build_model
from engine.weights.cache import load_weights
from modelinfo.info import ModelInfo
from protocol.kv_layout import KVLayout


def local_runner(
    info: ModelInfo,
    config: EngineConfig,
    layout: KVLayout,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> ModelRunner:
    """The whole model and its cache in this process."""
    mc = info.config
    weights = load_weights(info.source.kind, info.source.path, mc, config.cache_dir)
    backend = get_backend(config.attention_backend)
    model = build_model(mc, dtype=dtype, device=device, backend=backend, weights=weights)
    num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // layout.bytes_per_block)
    return ModelRunner(
        model,
        layout,
        num_blocks,
        device=device,
        dtype=dtype,
        backend=backend,
        cuda_graphs=config.cuda_graphs,
        compile_layers=config.compile_layers,
        max_batch=config.max_num_seqs,
        max_model_len=max_model_len,
        warm_up_tokens=config.max_num_batched_tokens,
    )

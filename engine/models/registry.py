"""Architecture name -> model class, and `build_model`, the one way to make a loaded model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.attention.base import AttentionBackend
from engine.models.llama import LlamaForCausalLM
from modelinfo.config import ModelConfig
from protocol.errors import UnsupportedArchitectureError

_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Glm4MoeForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": LlamaForCausalLM,
}
"""Hugging Face architecture names (config.json `architectures[0]`) kvserve runs; the same
set as modelinfo.config.SUPPORTED_ARCHITECTURES (which `kvserve check` reads, torch-free)."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The implementation of `architecture`; UnsupportedArchitectureError lists the known ones."""
    cls = _MODELS.get(architecture)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return cls


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    layer_start: int = 0,
    layer_end: int | None = None,
    weights: Mapping[str, torch.Tensor],
) -> LlamaForCausalLM:
    """Construct the model for layers [layer_start, layer_end) on `device` in `dtype` and load
    `weights` (HF names, any dtype; see engine/weights). Returned in eval mode, no grads."""
    cls = model_class(config.architecture)
    model = cls(
        config,
        backend,
        dtype=dtype,
        device=device,
        layer_start=layer_start,
        layer_end=layer_end,
    )
    model.load_weights(weights)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model

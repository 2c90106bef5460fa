"""MlaDecoderLayer: one DeepSeek-V2/V3 decoder layer (pre-norm residual blocks).

    x += o_proj(MlaAttention(rms_norm(x)))         engine/models/mla.py, latent KV cache
    x += mlp(rms_norm(x))                          SwiGLU, or SparseMoeBlock on sparse layers

LlamaForCausalLM (engine/models/llama.py) builds these instead of LlamaDecoderLayer for
an MLA config and owns the rest (embedding, pipeline stages, final norm, lm_head).
Checkpoint names are Hugging Face's DeepSeek ones under `model.layers.{i}.`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.mla import MlaAttention, rms_norm
from engine.models.moe import SparseMoeBlock
from engine.models.params import assign, meta_param
from modelinfo.config import ModelConfig
from protocol.errors import ModelLoadError


class MlaDecoderLayer(nn.Module):
    """Owns one layer's weights: norms, MLA projections, o_proj, and a dense SwiGLU (gate|up
    fused) or the mixture of experts of the config's sparse layers."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        layer: int = 0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        assert cfg.mla is not None
        if not backend.supports_mla:
            raise ModelLoadError(
                f"attention backend {backend.name!r} does not run MLA models "
                f"({cfg.architecture}); use torch or torch_lse"
            )
        self.cfg, self.backend = cfg, backend
        h = cfg.hidden_size
        self.input_norm = meta_param((h,), dtype)
        self.mla = MlaAttention(cfg, dtype)
        self.o_weight = meta_param((h, cfg.num_heads * cfg.mla.v_head_dim), dtype)
        self.o_bias = meta_param((h,), dtype) if cfg.attention_bias else None
        self.post_norm = meta_param((h,), dtype)
        self.moe: SparseMoeBlock | None = None
        self.gate_up_weight: nn.Parameter | None = None
        self.down_weight: nn.Parameter | None = None
        if cfg.is_sparse_layer(layer):
            self.moe = SparseMoeBlock(cfg, dtype, device or torch.device("cpu"))
        else:
            self.gate_up_weight = meta_param((2 * cfg.intermediate_size, h), dtype)
            self.down_weight = meta_param((h, cfg.intermediate_size), dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] residual stream
        cos: torch.Tensor,  # [T, 1, R]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        eps = self.cfg.rms_norm_eps
        h = rms_norm(x, self.input_norm, eps)
        attn = self.mla(h, cos, sin, kv_cache, meta, self.backend)  # [T, Hq Dv]
        x = x + F.linear(attn, self.o_weight, self.o_bias)
        h = rms_norm(x, self.post_norm, eps)
        if self.moe is not None:
            return x + self.moe(h)
        assert self.gate_up_weight is not None and self.down_weight is not None
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_weight)

    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        device: torch.device,
        missing: list[str],
    ) -> None:
        """Take this layer's HF tensors (names under `prefix`); absent names go to `missing`."""

        def get(name: str) -> torch.Tensor | None:
            if prefix + name not in weights:
                missing.append(prefix + name)
                return None
            return weights[prefix + name]

        self.mla.load(weights, prefix + "self_attn.", device, missing)
        sources = {
            "input_norm": get("input_layernorm.weight"),
            "o_weight": get("self_attn.o_proj.weight"),
            "post_norm": get("post_attention_layernorm.weight"),
        }
        if self.o_bias is not None:
            sources["o_bias"] = get("self_attn.o_proj.bias")
        if self.moe is not None:
            self.moe.load(weights, prefix + "mlp.", device, missing)
        else:
            gate, up = get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")
            sources["gate_up_weight"] = (
                None if gate is None or up is None else torch.cat([gate, up])
            )
            sources["down_weight"] = get("mlp.down_proj.weight")
        for attr, tensor in sources.items():
            if tensor is not None:
                assign(self, attr, tensor, device, prefix + attr)

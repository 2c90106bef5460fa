"""The Llama family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and its
mixture-of-experts relatives (Qwen3-MoE, Glm4Moe) over a flat batch.

One step runs T new tokens of many sequences as one [T, H] matrix (vLLM style): every
projection is one matmul over all T rows, and only attention looks at sequences, through
the AttentionBackend and its per-step AttentionMetadata.

Differences inside the family are config flags, not subclasses:
  * GQA: num_kv_heads <= num_heads;
  * attention_bias (Qwen2): bias on q/k/v;
  * qk_norm (Qwen3): per-head RMSNorm of q and k before RoPE;
  * tie_word_embeddings (SmolLM2, small Qwens): lm_head reuses the embedding matrix;
  * partial_rotary_factor (Glm4Moe): RoPE rotates only the leading dims of each head;
  * moe (Qwen3-MoE, Glm4Moe): the MLP of the config's sparse layers is a SparseMoeBlock
    (engine/models/moe.py), the other layers keep the dense SwiGLU;
  * mla (DeepSeek-V2/V3): attention is multi-head latent attention, a different layer
    (MlaDecoderLayer, engine/models/mla_layer.py) over a one-part latent cache; embedding,
    stages, final norm and lm_head are this module's.

Parameters are fused at load time: q|k|v into one [(Hq + 2 Hkv) D, H] matrix and
gate|up into one [2 I, H] matrix, so a layer is 4 matmuls. Checkpoint names are
Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...).

Pipeline stages: a module holds layers [layer_start, layer_end); the first stage owns
the embedding, the last the final norm and lm_head; kv_caches[i] is the cache of the
i-th layer of this module.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.layer_ops import EAGER, LayerOps
from engine.models.mla_layer import MlaDecoderLayer
from engine.models.moe import SparseMoeBlock
from engine.models.params import assign as _assign
from engine.models.params import meta_param as _param
from engine.rope import RotaryEmbedding
from modelinfo.config import ModelConfig
from protocol.errors import ModelLoadError

LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head")
"""The weights `linear` multiplies by (packed once on CPU in bf16: engine/models/cpu_gemm.py)."""


class LlamaDecoderLayer(nn.Module):
    """Owns one decoder layer's (fused) weights: attention with RoPE and a SwiGLU MLP, or
    a mixture-of-experts MLP on the config's sparse layers. `ops` runs the element-wise
    glue around the matmuls (engine/models/layer_ops.py: EAGER, or torch.compile'd on a
    CUDA engine with decode graphs)."""

    ops: LayerOps = EAGER

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        layer: int = 0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.backend = cfg, backend
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.scale = d**-0.5
        self.input_norm = _param((h,), dtype)
        self.qkv_weight = _param(((hq + 2 * hkv) * d, h), dtype)
        self.qkv_bias = _param(((hq + 2 * hkv) * d,), dtype) if cfg.attention_bias else None
        # q_norm's row repeated over the Hq query heads, then k_norm's over the Hkv heads.
        self.qk_norm_weight = _param((hq + hkv, d), dtype) if cfg.qk_norm else None
        self.o_weight = _param((h, hq * d), dtype)
        self.post_norm = _param((h,), dtype)
        self.moe: SparseMoeBlock | None = None
        self.gate_up_weight: nn.Parameter | None = None
        self.down_weight: nn.Parameter | None = None
        if cfg.is_sparse_layer(layer):
            self.moe = SparseMoeBlock(cfg, dtype, device or torch.device("cpu"))
        else:
            self.gate_up_weight = _param((2 * inter, h), dtype)
            self.down_weight = _param((h, inter), dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] residual stream
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        # RoPE inside the backend's cache write (a pure-decode step of the flex backend):
        # q, k leave attn_in unrotated. Compiled glue only: the kernel rounds the rotation
        # once from float32 as inductor's RoPE does (the eager glue rounds each op in 16
        # bits, as transformers does). Not for one row: its q|k|v GEMV rotates for free.
        in_write = (
            ops.fused
            and x.shape[0] > 1
            and self.qk_norm_weight is None
            and cos.shape[-1] == cfg.head_dim
            and self.backend.rotates_on_write(meta, kv_cache)
        )
        q, k, v = ops.attn_in(
            x,
            self.input_norm,
            self.qkv_weight,
            self.qkv_bias,
            self.qk_norm_weight,
            cos,
            sin,
            eps,
            cfg.num_heads,
            cfg.num_kv_heads,
            *((False,) if in_write else ()),
        )
        if in_write:
            attn = self.backend.forward_rotating(q, k, v, cos, sin, kv_cache, meta, self.scale)
        else:
            attn = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        if self.moe is None:
            assert self.gate_up_weight is not None and self.down_weight is not None
            if ops.post_attn is not None:  # o + norm + MLP as one op (layer_ops.py)
                return ops.post_attn(
                    x,
                    attn,
                    self.o_weight,
                    self.post_norm,
                    self.gate_up_weight,
                    self.down_weight,
                    eps,
                )
        x, h = ops.attn_out(x, attn, self.o_weight, self.post_norm, eps)
        if self.moe is not None:
            return x + self.moe(h)
        assert self.gate_up_weight is not None and self.down_weight is not None
        return ops.mlp(x, h, self.gate_up_weight, self.down_weight)

    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        device: torch.device,
        missing: list[str],
    ) -> None:
        """Take this layer's HF tensors (names under `prefix`), fusing q|k|v and gate|up."""

        def cat(names: list[str]) -> torch.Tensor | None:
            absent = [prefix + n for n in names if prefix + n not in weights]
            missing.extend(absent)
            if absent:
                return None
            if len(names) == 1:
                return weights[prefix + names[0]]
            try:
                return torch.cat([weights[prefix + n] for n in names])
            except RuntimeError:
                shapes = [tuple(weights[prefix + n].shape) for n in names]
                raise ModelLoadError(f"{prefix}{names} have mismatched shapes {shapes}") from None

        hq, hkv = self.cfg.num_heads, self.cfg.num_kv_heads
        att = "self_attn."
        sources = {
            "input_norm": cat(["input_layernorm.weight"]),
            "qkv_weight": cat([f"{att}{p}_proj.weight" for p in "qkv"]),
            "o_weight": cat([f"{att}o_proj.weight"]),
            "post_norm": cat(["post_attention_layernorm.weight"]),
        }
        if self.moe is not None:
            self.moe.load(weights, prefix + "mlp.", device, missing)
        else:
            sources["gate_up_weight"] = cat(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
            sources["down_weight"] = cat(["mlp.down_proj.weight"])
        if self.qkv_bias is not None:
            sources["qkv_bias"] = cat([f"{att}{p}_proj.bias" for p in "qkv"])
        if self.qk_norm_weight is not None:
            qn, kn = cat([f"{att}q_norm.weight"]), cat([f"{att}k_norm.weight"])
            if qn is not None and kn is not None:
                sources["qk_norm_weight"] = torch.cat([qn.expand(hq, -1), kn.expand(hkv, -1)])
        for attr, tensor in sources.items():
            if tensor is not None:
                _assign(self, attr, tensor, device, prefix + attr)


class LlamaForCausalLM(nn.Module):
    """Owns the weights of layers [layer_start, layer_end) of a Llama-family model, plus the
    embedding (first stage) and final norm + lm_head (last stage); no KV (caches are
    passed in) and no per-request state. Parameters are meta placeholders until
    `load_weights` (build_model does both). `ops` (engine/models/layer_ops.py) runs the
    final norm and the lm_head matmul, as the layers' `ops` run their glue."""

    ops: LayerOps = EAGER

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> None:
        super().__init__()
        layer_end = config.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= config.num_layers:
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) is not inside [0, {config.num_layers})"
            )
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = layer_start == 0, layer_end == config.num_layers
        h, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = _param((vocab, h), dtype) if self.is_first else None
        layer_cls = LlamaDecoderLayer if config.mla is None else MlaDecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(config, backend, dtype, i, self.device) for i in range(layer_start, layer_end)
        )
        self.norm = _param((h,), dtype) if self.is_last else None
        self.lm_head = _param((vocab, h), dtype) if self.is_last else None
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.rope_theta, config.rope_scaling, self.device
        )

    @property
    def num_local_layers(self) -> int:
        """How many layers (and KV caches) this module holds."""
        return self.layer_end - self.layer_start

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64 (first stage)
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # num_local_layers × [P, num_blocks, bs, Hkv, D]
        meta: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,  # [T, H] from the previous stage
    ) -> torch.Tensor:  # [T, H]: final-normed on the last stage, residual stream otherwise
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            x = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        else:
            if hidden_states is None:
                raise ValueError("a non-first pipeline stage needs hidden_states")
            x = hidden_states.to(self.dtype)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, 1, D] each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        if self.norm is not None:
            x = self.ops.norm(x, self.norm, self.config.rms_norm_eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, H] (final-normed rows to sample from) -> logits [N, V] in float32, or
        with `float32=False` in the model's dtype (the lm_head matmul's output, uncast)."""
        if self.lm_head is None:
            raise ValueError("compute_logits runs on the last pipeline stage only")
        if float32:
            return self.ops.logits(hidden, self.lm_head)
        return self.ops.logits(hidden, self.lm_head, False)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take HF-named tensors into this module's parameters, cast to its dtype and moved
        to its device (zero-copy where they already match; tensors of other stages are
        ignored). ModelLoadError names any missing tensor. Tied embeddings: lm_head reads
        model.embed_tokens.weight and, on a single stage, is the same Parameter."""
        missing: list[str] = []

        def take(attr: str, name: str) -> None:
            if getattr(self, attr) is None:
                return
            if name not in weights:
                missing.append(name)
            else:
                _assign(self, attr, weights[name], self.device, name)

        with torch.no_grad():
            take("embed_tokens", "model.embed_tokens.weight")
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, (LlamaDecoderLayer, MlaDecoderLayer))
                prefix = f"model.layers.{self.layer_start + i}."
                layer.load(weights, prefix, self.device, missing)
            take("norm", "model.norm.weight")
            if self.config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = self.embed_tokens if self.is_last else None
            elif self.config.tie_word_embeddings:
                take("lm_head", "model.embed_tokens.weight")
            else:
                take("lm_head", "lm_head.weight")
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ModelLoadError(
                f"the checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}{more}"
            )

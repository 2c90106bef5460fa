"""One decode rank's shard of a Llama-family model under TP x DCP (protocol/parallel.py).

Per layer, on rank r with shard s (group g, dcp rank d):

    x [T, H] (identical on every rank)
    qkv = x @ W_qkv[group q heads | group kv heads | group kv heads]   column parallel
    attention of the group's query heads over this rank's cache:
        DCP 1:  the torch reference backend                  -> [T, Hq_g, D]
        DCP P:  torch_lse on the stripe t ≡ d (mod P)        -> out [T, Hq_g, D], lse
                all-gather (out | lse) over the DCP group, merge_partials
    keep the owned query heads [q_head_start, q_head_end)    -> [T, Hq_own, D]
    x += all_reduce(attn_own @ W_o[:, owned heads])          row parallel
    x += all_reduce(silu(x W_gate[i0:i1]) * x W_up[i0:i1] @ W_down[:, i0:i1])
    MoE layers: x += all_reduce(SparseMoeBlock shard(x))     (see "Mixture of experts")

MLA layers (DeepSeek; engine/models/mla.py): the cache holds the whole latent on every
rank (its one "KV head" is every group's), the group's query heads are projected into the
latent space and attend over it (DCP: the stripe, merged like above, over L dims); the
owned heads' W_UV and o_proj columns follow, then the same all-reduce.

The embedding and final norm are replicated; only the driver (rank 0) loads lm_head and
computes logits. Weights are sliced from the full HF-named tensors at load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    LSEAttentionBackend,
    merge_partials,
)
from engine.models.layer_ops import rms_norm
from engine.models.mla import MlaAttention
from engine.models.moe import SparseMoeBlock
from engine.parallel.comm import ParallelContext, all_gather, all_reduce_
from engine.rope import RotaryEmbedding, apply_rotary
from modelinfo.config import ModelConfig
from protocol.errors import ModelLoadError
from protocol.parallel import DecodeRankShard, split_range


class Collective(NamedTuple):
    """One collective of a rank's forward: an all-reduce over every rank (device group)
    or a DCP all-gather, of a tensor of this shape and dtype."""

    kind: Literal["reduce", "gather"]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[start:end]


def _cols(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end]


class TPDecoderLayer(nn.Module):
    """Owns one layer's weight shard of one rank; runs the layer with its collectives."""

    def __init__(
        self,
        cfg: ModelConfig,
        shard: DecodeRankShard,
        ctx: ParallelContext,
        backend: AttentionBackend,
        lse_backend: LSEAttentionBackend | None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.cfg, self.shard, self.ctx = cfg, shard, ctx
        self.backend, self.lse_backend = backend, lse_backend
        if cfg.mla is not None and not backend.supports_mla:
            raise ModelLoadError(
                f"attention backend {backend.name!r} does not run MLA models "
                f"({cfg.architecture}); use torch or torch_lse"
            )
        self.scale = cfg.head_dim**-0.5
        self.weights: dict[str, torch.Tensor] = {}
        self.layer = layer
        self.moe: SparseMoeBlock | None = None
        self.mla: MlaAttention | None = None

    def load(self, weights: Mapping[str, torch.Tensor], prefix: str, dtype, device) -> None:  # type: ignore[no-untyped-def]
        """Slice this rank's part out of the HF tensors under `prefix`."""
        cfg, s, d = self.cfg, self.shard, self.cfg.head_dim
        i0, i1 = split_range(cfg.intermediate_size, s.tp_size, s.rank)

        def get(name: str) -> torch.Tensor:
            if prefix + name not in weights:
                raise ModelLoadError(f"the checkpoint lacks tensor {prefix + name}")
            return weights[prefix + name]

        att = "self_attn."
        qs, kvs = (s.group_q_start * d, s.group_q_end * d), (s.kv_head_start * d, s.kv_head_end * d)
        parts = {
            "input_norm": get("input_layernorm.weight"),
            "post_norm": get("post_attention_layernorm.weight"),
        }
        if cfg.mla is not None:
            self.mla = _load_mla_shard(cfg, s, weights, prefix + att, dtype, device)
            dv = cfg.mla.v_head_dim
            o = get(att + "o_proj.weight")
            parts["o_weight"] = _cols(o, s.q_head_start * dv, s.q_head_end * dv)
            if cfg.attention_bias:
                parts["o_bias"] = get(att + "o_proj.bias")
        else:
            parts["qkv_weight"] = torch.cat(
                [
                    _rows(get(att + "q_proj.weight"), *qs),
                    _rows(get(att + "k_proj.weight"), *kvs),
                    _rows(get(att + "v_proj.weight"), *kvs),
                ]
            )
            parts["o_weight"] = _cols(
                get(att + "o_proj.weight"), s.q_head_start * d, s.q_head_end * d
            )
        if cfg.is_sparse_layer(self.layer):
            self.moe = _load_moe_shard(cfg, s, weights, prefix, dtype, device)
        else:
            parts["gate_up_weight"] = torch.cat(
                [
                    _rows(get("mlp.gate_proj.weight"), i0, i1),
                    _rows(get("mlp.up_proj.weight"), i0, i1),
                ]
            )
            parts["down_weight"] = _cols(get("mlp.down_proj.weight"), i0, i1)
        if cfg.attention_bias and cfg.mla is None:
            parts["qkv_bias"] = torch.cat(
                [
                    _rows(get(att + "q_proj.bias"), *qs),
                    _rows(get(att + "k_proj.bias"), *kvs),
                    _rows(get(att + "v_proj.bias"), *kvs),
                ]
            )
        if cfg.qk_norm:
            qn, kn = get(att + "q_norm.weight"), get(att + "k_norm.weight")
            parts["qk_norm_weight"] = torch.cat(
                [qn.expand(s.num_group_q_heads, -1), kn.expand(s.num_kv_heads, -1)]
            )
        self.weights = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in parts.items()}

    def forward(
        self,
        x: torch.Tensor,  # [T, H], the same on every rank
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv_g, D] (this rank's stripe)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        w, s, cfg = self.weights, self.shard, self.cfg
        num_tokens, d = x.shape[0], cfg.head_dim
        hq, hkv = s.num_group_q_heads, s.num_kv_heads
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        if self.mla is not None:
            x = x + self._mla_attention(h, cos, sin, kv_cache, meta)
            return self._mlp(x)
        qkv = F.linear(h, w["qkv_weight"], w.get("qkv_bias"))  # [T, (Hq_g + 2 Hkv_g) D]
        qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
        if "qk_norm_weight" in w:
            qk = rms_norm(qk, w["qk_norm_weight"], cfg.rms_norm_eps)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        if self.ctx.dcp_group is None:
            attn = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq_g, D]
        else:
            assert self.lse_backend is not None
            out, lse = self.lse_backend.forward_with_lse(q, k, v, kv_cache, meta, self.scale)
            packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)  # [T, Hq_g, D + 1]
            parts = self._gather(packed)
            attn = merge_partials(parts[..., :d], parts[..., d]).to(x.dtype)
        own0 = s.q_head_start - s.group_q_start
        own = attn[:, own0 : own0 + s.q_head_end - s.q_head_start].reshape(num_tokens, -1)
        x = x + self._reduce(F.linear(own, w["o_weight"]))
        return self._mlp(x)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_(x)
        self.ctx.num_collectives += 1
        return out

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        assert self.ctx.dcp_group is not None
        out = all_gather(x, self.ctx.dcp_group, self.ctx.dcp_size)
        self.ctx.num_collectives += 1
        return out

    def collectives(self, num_tokens: int, dtype: torch.dtype) -> list[Collective]:
        """The collectives this layer's forward makes over `num_tokens` tokens, in order
        (what a rank whose forward failed must still take part in)."""
        out: list[Collective] = []
        if self.ctx.dcp_group is not None:
            s, cfg = self.shard, self.cfg
            width = cfg.mla.kv_lora_rank if cfg.mla is not None else cfg.head_dim
            shape = (num_tokens, s.num_group_q_heads, width + 1)
            out.append(Collective("gather", shape, torch.float32))
        reduce = Collective("reduce", (num_tokens, self.cfg.hidden_size), dtype)
        return [*out, reduce, reduce]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        w, cfg = self.weights, self.cfg
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        if self.moe is not None:
            return x + self._reduce(self.moe(h))
        gate, up = F.linear(h, w["gate_up_weight"]).chunk(2, dim=-1)
        return x + self._reduce(F.linear(F.silu(gate) * up, w["down_weight"]))

    def _mla_attention(
        self,
        h: torch.Tensor,  # [T, H] normed
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R] (this rank's stripe)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H], all-reduced attention output
        assert self.mla is not None and self.cfg.mla is not None
        s, m = self.shard, self.cfg.mla
        q, entry = self.mla.project(h, cos, sin)  # the group's heads
        lat = m.kv_lora_rank
        if self.ctx.dcp_group is None:
            o_lat = self.backend.forward_mla(q, entry, kv_cache, meta, m.softmax_scale, lat)
        else:
            assert self.lse_backend is not None
            out, lse = self.lse_backend.forward_mla_with_lse(
                q, entry, kv_cache, meta, m.softmax_scale, lat
            )
            packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)  # [T, Hq_g, L + 1]
            parts = self._gather(packed)
            o_lat = merge_partials(parts[..., :lat], parts[..., lat]).to(h.dtype)
        own0 = s.q_head_start - s.group_q_start
        own = self.mla.expand(o_lat[:, own0 : own0 + s.q_head_end - s.q_head_start], own0)
        out = self._reduce(F.linear(own, self.weights["o_weight"]))
        bias = self.weights.get("o_bias")
        return out if bias is None else out + bias


# --- Mixture of experts ---------------------------------------------------------------
# Experts are sharded like the dense MLP: rank r of TP size P holds the slice
# split_range(I, P, r) of EVERY routed expert's intermediate dim (and of the shared
# expert's), the router whole. All ranks see the same x, route identically, and each
# returns a partial sum of the experts' down projections that the layer all-reduces, one
# collective as for the dense MLP. Chosen over whole experts per rank (expert parallel)
# because it needs no token exchange, balances the work whatever the routing, and is exact.


def _load_moe_shard(
    cfg: ModelConfig,
    shard: DecodeRankShard,
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    dtype: torch.dtype,
    device: torch.device,
) -> SparseMoeBlock:
    """This rank's slice of layer `prefix`'s mixture of experts, loaded."""
    block = SparseMoeBlock(cfg, dtype, device, tp_rank=shard.rank, tp_size=shard.tp_size)
    missing: list[str] = []
    with torch.no_grad():
        block.load(weights, prefix + "mlp.", device, missing)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks tensor {missing[0]}")
    block.eval()
    return block


def _load_mla_shard(
    cfg: ModelConfig,
    shard: DecodeRankShard,
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    dtype: torch.dtype,
    device: torch.device,
) -> MlaAttention:
    """The MLA projections of the group's query heads (the latent projection whole)."""
    mla = MlaAttention(cfg, dtype, heads=(shard.group_q_start, shard.group_q_end))
    missing: list[str] = []
    with torch.no_grad():
        mla.load(weights, prefix, device, missing)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks tensor {missing[0]}")
    mla.eval()
    return mla


class TPLlamaModel(nn.Module):
    """Owns one rank's shard of every layer, the replicated embedding and final norm, and
    (driver only) lm_head. No KV (caches are passed in), no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        shard: DecodeRankShard,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype,
        backend: AttentionBackend,
        lse_backend: LSEAttentionBackend | None,
    ) -> None:
        super().__init__()
        self.config, self.shard, self.ctx, self.dtype = config, shard, ctx, dtype
        self.device = ctx.device
        self.layers = [
            TPDecoderLayer(config, shard, ctx, backend, lse_backend, i)
            for i in range(config.num_layers)
        ]
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.rope_theta, config.rope_scaling, self.device
        )
        self.embed_tokens = torch.empty(0)
        self.norm = torch.empty(0)
        self.lm_head: torch.Tensor | None = None

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        dev, dt = self.device, self.dtype

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"the checkpoint lacks tensor {name}")
            return weights[name].to(device=dev, dtype=dt)

        with torch.no_grad():
            self.embed_tokens = get("model.embed_tokens.weight")
            self.norm = get("model.norm.weight")
            if self.ctx.is_driver:
                tied = self.config.tie_word_embeddings
                self.lm_head = self.embed_tokens if tied else get("lm_head.weight")
            for i, layer in enumerate(self.layers):
                layer.load(weights, f"model.layers.{i}.", dt, dev)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, H] final-normed
        """`before_layer(i)`: called before layer i (test-only fault injection)."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, cos, sin, kv_cache, meta)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def collectives(self, num_tokens: int) -> list[Collective]:
        """Every collective of a forward over `num_tokens` tokens, in order."""
        return [c for layer in self.layers for c in layer.collectives(num_tokens, self.dtype)]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32; the driver only."""
        if self.lm_head is None:
            raise ValueError("compute_logits runs on the driver rank only")
        return F.linear(hidden, self.lm_head).float()

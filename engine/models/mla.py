"""MlaAttention: multi-head latent attention (DeepSeek-V2/V3) with weight absorption.

Per token (h = the normed residual, H heads of this module, R = qk_rope_head_dim,
N = qk_nope_head_dim, L = kv_lora_rank, Dv = v_head_dim):

    q = q_proj(h)  or  q_b_proj(rms_norm(q_a_proj(h)))          [H, N + R] -> q_nope, q_pe
    c, k_pe = kv_a_proj_with_mqa(h)                               [L], [R] (one per token)
    c = rms_norm(c, kv_a_layernorm)
    q_pe, k_pe = rope(q_pe), rope(k_pe)                           (interleaved pairs)
    kv_b_proj = [W_UK[h] (N x L); W_UV[h] (Dv x L)] per head h

transformers expands every cached token into keys (W_UK c, k_pe) and values W_UV c per
head. Absorbing W_UK into the query and W_UV into the output gives the same attention
over the cached (c, k_pe) directly, with one shared "KV head" of L + R dims:

    q_lat[h]  = W_UK[h]^T q_nope[h]                               [L]
    score     = (q_lat[h] . c + q_pe[h] . k_pe) * softmax_scale
              = (q_nope[h] . W_UK[h] c + q_pe[h] . k_pe) * scale   (the expanded score)
    o_lat[h]  = sum_t p_t c_t                                     [L]   (values = c)
    out[h]    = W_UV[h] o_lat[h]                                   [Dv]

so the cache holds one entry (c, k_pe) of L + R elements per token and layer
(protocol/kv_layout.py, kind "mla"), prefill and decode both attend over it (an
AttentionBackend's `forward_mla`), and decode never materializes per-head keys. The
module may hold a slice [h0, h1) of the heads (decode TP): q and kv_b rows of those
heads; the latent (kv_a) is whole on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.params import assign, meta_param
from engine.rope import apply_rotary, apply_rotary_interleaved
from modelinfo.config import ModelConfig
from protocol.errors import ModelLoadError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D] in float32, cast back before the weight, as HF does (a copy of
    engine/models/llama.py's, which imports this module: importing it would be circular)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class MlaAttention(nn.Module):
    """Owns one layer's MLA projections for query heads [h0, h1) (all by default): the
    query path, the shared latent projection and norm, and kv_b split into W_UK / W_UV.
    o_proj stays with the caller (its columns depend on which heads' outputs it owns)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, heads: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.cfg, self.m = cfg, cfg.mla
        m, h = cfg.mla, cfg.hidden_size
        self.heads = (0, cfg.num_heads) if heads is None else heads
        nh = self.heads[1] - self.heads[0]
        bias = cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_a = self.q_a_bias = self.q_a_norm = None
            self.q_weight = meta_param((nh * m.qk_head_dim, h), dtype)
        else:
            self.q_a = meta_param((m.q_lora_rank, h), dtype)
            self.q_a_bias = meta_param((m.q_lora_rank,), dtype) if bias else None
            self.q_a_norm = meta_param((m.q_lora_rank,), dtype)
            self.q_weight = meta_param((nh * m.qk_head_dim, m.q_lora_rank), dtype)
        self.kv_a = meta_param((m.latent_dim, h), dtype)
        self.kv_a_bias = meta_param((m.latent_dim,), dtype) if bias else None
        self.kv_a_norm = meta_param((m.kv_lora_rank,), dtype)
        self.w_uk = meta_param((nh, m.qk_nope_head_dim, m.kv_lora_rank), dtype)
        self.w_uv = meta_param((nh, m.v_head_dim, m.kv_lora_rank), dtype)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] normed, cos/sin [T, 1, R] -> (q [T, nh, L + R] latent-space queries,
        entry [T, 1, L + R] this token's cache entry (c, k_pe))."""
        m, eps = self.m, self.cfg.rms_norm_eps
        num_tokens = h.shape[0]
        if self.q_a is None:
            q = F.linear(h, self.q_weight)
        else:
            assert self.q_a_norm is not None
            q_low = rms_norm(F.linear(h, self.q_a, self.q_a_bias), self.q_a_norm, eps)
            q = F.linear(q_low, self.q_weight)
        q = q.view(num_tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        ckv = F.linear(h, self.kv_a, self.kv_a_bias)  # [T, L + R]
        c = rms_norm(ckv[:, : m.kv_lora_rank], self.kv_a_norm, eps)
        k_pe = ckv[:, None, m.kv_lora_rank :]  # [T, 1, R]
        rope = apply_rotary_interleaved if m.rope_interleave else apply_rotary
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe, cos, sin)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)  # [T, nh, L]
        return torch.cat((q_lat, q_pe), dim=-1), torch.cat((c[:, None], k_pe), dim=-1)

    def expand(self, o_lat: torch.Tensor, first: int = 0) -> torch.Tensor:
        """o_lat [T, n, L] (attention output over the latent) of this module's heads
        first .. first + n -> their values W_UV o_lat, [T, n * Dv]."""
        n = o_lat.shape[1]
        out = torch.einsum("thl,hvl->thv", o_lat, self.w_uv[first : first + n])
        return out.reshape(o_lat.shape[0], n * self.m.v_head_dim)

    def forward(
        self,
        h: torch.Tensor,  # [T, H] normed
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, nh * Dv], before o_proj
        q, entry = self.project(h, cos, sin)
        o_lat = backend.forward_mla(
            q, entry, kv_cache, meta, self.m.softmax_scale, self.m.kv_lora_rank
        )
        return self.expand(o_lat)

    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        device: torch.device,
        missing: list[str],
    ) -> None:
        """Take the layer's `self_attn.` tensors (HF names under `prefix`, e.g.
        "model.layers.3.self_attn."), the query and kv_b rows of heads [h0, h1) only."""
        m = self.m
        h0, h1 = self.heads

        def get(name: str) -> torch.Tensor | None:
            if prefix + name not in weights:
                missing.append(prefix + name)
                return None
            return weights[prefix + name]

        sources: dict[str, torch.Tensor | None] = {
            "kv_a": get("kv_a_proj_with_mqa.weight"),
            "kv_a_norm": get("kv_a_layernorm.weight"),
        }
        if self.kv_a_bias is not None:
            sources["kv_a_bias"] = get("kv_a_proj_with_mqa.bias")
        q_name = "q_proj.weight" if self.q_a is None else "q_b_proj.weight"
        q = get(q_name)
        if q is not None:
            sources["q_weight"] = q[h0 * m.qk_head_dim : h1 * m.qk_head_dim]
        if self.q_a is not None:
            sources["q_a"] = get("q_a_proj.weight")
            sources["q_a_norm"] = get("q_a_layernorm.weight")
            if self.q_a_bias is not None:
                sources["q_a_bias"] = get("q_a_proj.bias")
        kv_b = get("kv_b_proj.weight")
        if kv_b is not None:
            per_head = m.qk_nope_head_dim + m.v_head_dim
            if tuple(kv_b.shape) != (self.cfg.num_heads * per_head, m.kv_lora_rank):
                raise ModelLoadError(
                    f"{prefix}kv_b_proj.weight has shape {tuple(kv_b.shape)}, the config "
                    f"implies {(self.cfg.num_heads * per_head, m.kv_lora_rank)}"
                )
            kv_b = kv_b.view(self.cfg.num_heads, per_head, m.kv_lora_rank)[h0:h1]
            sources["w_uk"] = kv_b[:, : m.qk_nope_head_dim]
            sources["w_uv"] = kv_b[:, m.qk_nope_head_dim :]
        for attr, tensor in sources.items():
            if tensor is not None:
                assign(self, attr, tensor.contiguous(), device, prefix + attr)

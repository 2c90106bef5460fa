"""The "torch_lse" attention backend: paged attention in plain PyTorch that also returns
each row's log-sum-exp, over a cache that may hold only a DCP stripe of the tokens.

Decode context parallelism (DESIGN §6) gives rank r of a DCP group of P ranks the tokens
t ≡ r (mod P), at local position j = t // P. A new token at global position p attends to
the local keys whose global position j * P + r is <= p:

    P = 2, r = 1, seq_len 7, last 3 tokens new (positions 4 5 6):
        local j      0  1  2          (global 1 3 5)
        query p=4    x  x  .
        query p=5    x  x  x
        query p=6    x  x  x

Partial results of the P ranks merge exactly with `merge_partials` (engine/attention/
base.py). Scores are computed in float32 explicitly (SDPA does not return the LSE), so
this path is slower than the "torch" reference and used only where the LSE is needed.
Like the reference, decode rows run as one padded batch, prefill rows per sequence; MLA
(`forward_mla_with_lse`) runs both over the one-part latent cache (keys the entries,
values their leading value_dim dims), so its partials merge the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata, LSEAttentionBackend, register_backend
from engine.attention.kv_quant import from_cache, head_dim_of, to_cache
from protocol.parallel import stripe_len


@dataclass
class _Seq:
    """A multi-token sequence of the step: its query rows and its local keys."""

    q_start: int
    q_end: int
    num_local: int
    blocks: torch.Tensor  # [ceil(num_local / block_size)] int64
    mask: torch.Tensor  # [q_len, num_local] bool, True = attend


@dataclass
class _Plan:
    """Per-step plan shared by every layer (meta.backend_state["torch_lse"])."""

    write_rows: torch.Tensor | None  # [W] rows of new tokens held here; None = all rows
    write_slots: torch.Tensor  # [W]
    decode_rows: torch.Tensor | None  # [Bd] query rows of q_len == 1 sequences
    decode_blocks: torch.Tensor | None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool
    prefills: list[_Seq] = field(default_factory=list)


def _build_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
    size, rank = meta.dcp_size, meta.dcp_rank
    slots = meta.slot_mapping
    if size == 1:
        write_rows, write_slots = None, slots
    else:
        write_rows = torch.nonzero(slots >= 0).flatten()
        write_slots = slots.index_select(0, write_rows)
    plan = _Plan(write_rows, write_slots, None, None, None)
    q_lens, seq_lens, starts = meta.query_lens(), meta.seq_lens, meta.query_start_loc
    local = [stripe_len(0, n, size, rank) for n in seq_lens]
    decode = [b for b, q in enumerate(q_lens) if q == 1]
    if decode:
        max_blocks = max(1, -(-max(local[b] for b in decode) // block_size))
        plan.decode_rows = torch.tensor([starts[b] for b in decode], device=device)
        idx = torch.tensor(decode, dtype=torch.int64, device=device)
        plan.decode_blocks = meta.block_tables.index_select(0, idx)[:, :max_blocks]
        lens = torch.tensor([local[b] for b in decode], device=device)
        key = torch.arange(max_blocks * block_size, device=device)
        plan.decode_mask = (key[None, :] < lens[:, None])[:, None, None, :]
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        key_pos = torch.arange(local[b], device=device) * size + rank  # global positions
        q_pos = torch.arange(seq_lens[b] - q_len, seq_lens[b], device=device)
        blocks = meta.block_tables[b, : -(-local[b] // block_size)]
        mask = key_pos[None, :] <= q_pos[:, None]
        plan.prefills.append(_Seq(starts[b], starts[b + 1], local[b], blocks, mask))
    return plan


def _attend(
    q: torch.Tensor,  # [B, Hkv, G, Q, D]
    k: torch.Tensor,  # [B, Hkv, K, D]
    v: torch.Tensor,  # [B, Hkv, K, Dv]
    mask: torch.Tensor,  # broadcastable to [B, Hkv, G, Q, K], True = attend
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, G, Q, Dv] float32, [B, Hkv, G, Q]
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key is visible
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe.unsqueeze(-1))  # exp(-inf) = 0 on masked keys
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float()), lse


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[P, blocks, bs, Hkv, W] x [n] -> [P, n * bs, Hkv, D] values of `dtype` (whole-block
    row copies, fp8 rows dequantized)."""
    parts, _, bs, hkv, width = kv_cache.shape
    out = kv_cache.view(parts, kv_cache.shape[1], -1).index_select(1, blocks)
    return from_cache(out.view(parts, blocks.numel() * bs, hkv, width), dtype)


def _split(kv: torch.Tensor, value_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of gathered KV: parts 0 and 1, or (MLA, one part) the entries and
    their leading value_dim dims."""
    return (kv[0], kv[1]) if value_dim is None else (kv[0], kv[0][..., :value_dim])


@register_backend
class TorchLSEAttentionBackend(LSEAttentionBackend):
    """Reference LSE attention over a (possibly DCP-striped) paged cache; no state
    between steps."""

    name = "torch_lse"

    def forward_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hq]
        plan = self._plan(q, kv_cache, meta)
        num_kv_heads, width = kv_cache.shape[3], kv_cache.shape[4]
        flat = kv_cache.view(2, -1, num_kv_heads, width)
        k_new = k if plan.write_rows is None else k.index_select(0, plan.write_rows)
        v_new = v if plan.write_rows is None else v.index_select(0, plan.write_rows)
        flat[0].index_copy_(0, plan.write_slots, to_cache(k_new, kv_cache))
        flat[1].index_copy_(0, plan.write_slots, to_cache(v_new, kv_cache))
        return self._attend_all(q, kv_cache, plan, scale, None)

    supports_mla = True

    def forward_mla_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, C]
        latent: torch.Tensor,  # [T, 1, C]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, C]
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, value_dim], [T, Hq]
        plan = self._plan(q, kv_cache, meta)
        new = latent if plan.write_rows is None else latent.index_select(0, plan.write_rows)
        flat = kv_cache.view(-1, 1, kv_cache.shape[-1])
        flat.index_copy_(0, plan.write_slots, to_cache(new, kv_cache))
        return self._attend_all(q, kv_cache, plan, scale, value_dim)

    def _plan(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> _Plan:
        plan = meta.backend_state.get(self.name)
        if plan is None:
            plan = _build_plan(meta, kv_cache.shape[2], q.device)
            meta.backend_state[self.name] = plan
        return plan

    @staticmethod
    def _attend_all(
        q: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [P, num_blocks, block_size, Hkv, D]
        plan: _Plan,
        scale: float,
        value_dim: int | None,  # MLA: values are the entries' leading value_dim dims
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, Dv], [T, Hq]
        parts, _, block_size, num_kv_heads, _ = kv_cache.shape
        head_dim = head_dim_of(kv_cache)
        num_tokens, num_heads, _ = q.shape
        group = num_heads // num_kv_heads
        out_dim = head_dim if value_dim is None else value_dim
        out = torch.zeros(num_tokens, num_heads, out_dim, dtype=q.dtype, device=q.device)
        lse = torch.full((num_tokens, num_heads), float("-inf"), device=q.device)
        if plan.decode_rows is not None:
            assert plan.decode_blocks is not None and plan.decode_mask is not None
            rows = plan.decode_rows
            num_seqs, max_blocks = plan.decode_blocks.shape
            kv = _gather(kv_cache, plan.decode_blocks.reshape(-1), q.dtype)
            kv = kv.view(parts, num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
            kv = kv.permute(0, 1, 3, 2, 4)  # [P, Bd, Hkv, L, D]
            q_dec = q.index_select(0, rows).view(num_seqs, num_kv_heads, group, 1, head_dim)
            k, v = _split(kv, value_dim)
            o, s = _attend(q_dec, k, v, plan.decode_mask.unsqueeze(-2), scale)
            out.index_copy_(0, rows, o.reshape(num_seqs, num_heads, out_dim).to(q.dtype))
            lse.index_copy_(0, rows, s.reshape(num_seqs, num_heads))
        for seq in plan.prefills:
            if seq.num_local == 0:
                continue  # no key of this sequence on this rank: out 0, lse -inf
            q_len = seq.q_end - seq.q_start
            kv = _gather(kv_cache, seq.blocks, q.dtype)[:, : seq.num_local]  # [P, n, Hkv, D]
            kv = kv.permute(0, 2, 1, 3).unsqueeze(1)  # [P, 1, Hkv, n, D]
            q_s = q[seq.q_start : seq.q_end].view(q_len, num_kv_heads, group, head_dim)
            q_s = q_s.permute(1, 2, 0, 3).unsqueeze(0)  # [1, Hkv, G, q_len, D]
            k, v = _split(kv, value_dim)
            o, s = _attend(q_s, k, v, seq.mask, scale)
            out[seq.q_start : seq.q_end] = o[0].permute(2, 0, 1, 3).reshape(q_len, num_heads, -1)
            lse[seq.q_start : seq.q_end] = s[0].permute(2, 0, 1).reshape(q_len, num_heads)
        return out, lse

"""A CPU stand-in for the compiled FlexAttention kernel, for unit tests of the "flex"
backend's block masks on machines without CUDA.

It computes exactly what the kernel computes from a BlockMask: for each (batch row,
query tile) it visits the FULL tiles unmasked and evaluates mask_mod on the PARTIAL tiles
only; keys in no listed tile are skipped. (Eager flex_attention instead evaluates
mask_mod everywhere, which is not the contract the backend relies on.) float64 inside.
"""

from __future__ import annotations

from typing import Any

import torch


def simulate_flex(
    q: torch.Tensor,  # [B, Hq, L, D]
    k: torch.Tensor,  # [1 or B, Hkv, S, D]
    v: torch.Tensor,
    *,
    block_mask: Any,
    scale: float,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
) -> Any:
    num_seqs, num_heads, q_len, _ = q.shape
    num_slots = k.shape[2]
    q_block, kv_block = block_mask.BLOCK_SIZE
    assert block_mask.seq_lengths == (q_len, num_slots), (block_mask.seq_lengths, q.shape)
    options = kernel_options or {}
    assert kv_block % options.get("BLOCK_N", kv_block) == 0
    group = num_heads // k.shape[1]
    assert enable_gqa == (group != 1)
    allowed = torch.zeros(num_seqs, q_len, num_slots, dtype=torch.bool)
    dev = block_mask.kv_indices.device  # where mask_mod's captured tensors live
    lists = (
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, False),
        (block_mask.kv_num_blocks, block_mask.kv_indices, True),
    )
    for b in range(num_seqs):
        mb = b if block_mask.kv_num_blocks.shape[0] > 1 else 0
        for m in range(-(-q_len // q_block)):
            q_idx = torch.arange(m * q_block, min((m + 1) * q_block, q_len))
            for counts, indices, masked in lists:
                if counts is None:  # no full tiles
                    continue
                count = int(counts[mb, 0, m])
                for tile in indices[mb, 0, m, :count].tolist():
                    kv_idx = torch.arange(tile * kv_block, (tile + 1) * kv_block)
                    cols = slice(tile * kv_block, (tile + 1) * kv_block)
                    if not masked:
                        allowed[b, q_idx, cols] = True
                        continue
                    keep = block_mask.mask_mod(
                        torch.tensor(b, device=dev),
                        torch.tensor(0, device=dev),
                        q_idx[:, None].to(dev),
                        kv_idx[None, :].to(dev),
                    )
                    allowed[b, q_idx, cols] = keep.expand(len(q_idx), kv_block).cpu()
    kk = k.double().cpu().repeat_interleave(group, dim=1).expand(num_seqs, -1, -1, -1)
    vv = v.double().cpu().repeat_interleave(group, dim=1).expand(num_seqs, -1, -1, -1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double().cpu(), kk) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, L]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - safe[..., None]), vv)
    out = out.to(q.dtype).to(q.device)
    lse = lse.float().to(q.device)
    return (out, lse) if return_lse else out

"""Top-k expert choice of the mixture-of-experts families, as transformers computes it.

    softmax (Qwen3-MoE,   p = softmax(logits) over all E experts (float32)
      DeepSeek-V2):       group_limited_greedy (V2): a group scores its best p; only the
                          topk_group best groups stay eligible
                          ids = top-k(p); w = p[ids] (/ sum w if norm_topk_prob)
                          x routed_scaling_factor
    sigmoid (Glm4Moe,     s = sigmoid(logits) (float32); c = s + e_score_correction_bias
      DeepSeek-V3)        groups: E experts in G groups, a group scores the sum of its
                          best two c; only the topk_group best groups stay eligible
                          ids = top-k(c) over eligible experts; w = s[ids] (not c)
                          (/ (sum w + 1e-20) if norm_topk_prob) x routed_scaling_factor

The correction bias only steers the choice (load balancing); the weights are the plain
sigmoid scores.
"""

from __future__ import annotations

import torch

from modelinfo.config import MoeConfig


def route(
    logits: torch.Tensor,  # [T, E] router logits
    moe: MoeConfig,
    score_bias: torch.Tensor | None,  # [E] float32, sigmoid scoring only
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, K] float32, expert ids [T, K] int64) for every token."""
    if moe.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(_eligible(probs, moe), moe.top_k, dim=-1)
        weights = probs.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        # transformers rounds the weights to the logits' dtype before the experts use them.
        return weights.to(logits.dtype).float(), ids
    scores = logits.float().sigmoid()
    choice = _eligible(scores if score_bias is None else scores + score_bias, moe)
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _eligible(choice: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's topk_groups best groups set to
    -inf (grouped top-k); unchanged without groups."""
    if moe.num_groups <= 1 or moe.topk_groups >= moe.num_groups:
        return choice
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, moe.num_groups, -1)  # [T, G, E/G]
    if moe.group_score == "max":
        group_scores = grouped.max(dim=-1).values  # [T, G]
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, -1)

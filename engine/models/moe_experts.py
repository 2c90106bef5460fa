"""The routed experts of a mixture-of-experts layer: two exact implementations.

Weights of all E experts are stacked: w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I]. A token routed to experts ids[t] with weights w[t] gets

    y[t] = sum_k w[t, k] * (silu(x[t] W_gate[e]^T) * (x[t] W_up[e]^T)) W_down[e]^T,  e = ids[t, k]

Both implementations first sort the T x K (token, expert) pairs by expert (a stable
argsort), so each expert's rows are contiguous:

  * "grouped": two `torch._grouped_mm` calls over the sorted rows, one per projection,
    with the per-expert row counts as offsets; no host sync, no Python loop. The fast
    path on CUDA in bfloat16 (CUTLASS grouped GEMM on sm90+); torch also runs it on CPU.
  * "loop": one pair of matmuls per expert that received rows (the experts' row counts
    come to the host once). The CPU path and the reference.

Each (token, expert) row's output is weighted in float32 and summed over its K experts in
a fixed order (k = 0..K-1), the same in both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERT_IMPLS = ("grouped", "loop")


def default_impl(device: torch.device, dtype: torch.dtype) -> str:
    """The grouped GEMM where torch has it and it pays (CUDA, 16-bit); the loop elsewhere."""
    grouped = hasattr(torch, "_grouped_mm") and device.type == "cuda"
    return "grouped" if grouped and dtype in (torch.bfloat16, torch.float16) else "loop"


def _sorted_rows(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (order [T*K]: (token, k) pair positions sorted by expert, counts [E] int64)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add rather than bincount: bincount on CUDA reads the max id back to the host
    # to size its output, a sync per layer (and no CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return order, counts.scatter_add_(0, flat, torch.ones_like(flat))


def _combine(
    rows: torch.Tensor,  # [T*K, H] outputs in expert order
    order: torch.Tensor,  # [T*K]
    weights: torch.Tensor,  # [T, K] float32
) -> torch.Tensor:  # [T, H] in rows' dtype
    num_tokens, k = weights.shape
    unsorted = torch.empty_like(rows)
    unsorted[order] = rows
    out = unsorted.view(num_tokens, k, -1).float() * weights[..., None]
    return out.sum(dim=1).to(rows.dtype)


def experts_grouped(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] float32
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [T, H]
    order, counts = _sorted_rows(ids, w13.shape[0])
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)  # end row of each expert
    xs = x[order // ids.shape[1]]  # [T*K, H] the token of each sorted row
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    rows = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)  # [T*K, H]
    return _combine(rows, order, weights)


def experts_loop(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] float32
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [T, H]
    order, counts = _sorted_rows(ids, w13.shape[0])
    xs = x[order // ids.shape[1]]
    rows = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start : start + n], w13[expert]).chunk(2, dim=-1)
            rows[start : start + n] = F.linear(F.silu(gate) * up, w2[expert])
            start += n
    return _combine(rows, order, weights)


def run_experts(
    impl: str,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] by implementation `impl` (EXPERT_IMPLS)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if impl == "grouped":
        return experts_grouped(x, ids, weights, w13, w2)
    if impl == "loop":
        return experts_loop(x, ids, weights, w13, w2)
    raise ValueError(f"expert implementation {impl!r} is not one of {EXPERT_IMPLS}")

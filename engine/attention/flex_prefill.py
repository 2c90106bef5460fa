"""Long prefill rows of the flex backend: cuDNN's dense attention over the gathered
prefix plus the chunk's own keys, merged by their log-sum-exps.

A chunk of N new tokens behind a cached prefix of P tokens attends to P + N keys with a
lower-right causal mask. SDPA runs that through FlashAttention-2 (~340 TFLOP/s on an
H200); cuDNN's attention runs at ~570-600 but keeps the upper-left diagonal when queries
are fewer than keys (benchmarks/gpu_engine_prefill_attn.py measured both). So the work is
split where no such mask is needed:

    keys:     [ bulk: P_a = P rounded down to KV_GRAIN | tail: P_b | new: N ]
    A: all N queries x bulk keys, no mask                      -> o_A, lse_A
    B: square causal over [tail | new]: the tail's positions get zero query rows in
       front (outputs dropped), so query i of the chunk, at row P_b + i, sees the tail
       and the new keys <= i: the lower-right mask, from an upper-left one
    out = merge(o_A, lse_A, o_B[P_b:], lse_B[P_b:])                 (exact, by LSE)

cuDNN builds an execution plan per shape (45-80 ms on first use), so shapes are
bucketed: A's query rows are padded (zeros, rows dropped) to `bucket(N)` (8 sizes per
power of two), its keys are P_a (a multiple of KV_GRAIN: the tail takes the rest), and
B's square is padded at the end to `bucket(P_b + N)` with zero keys that only the dropped
rows see. The plans in use stay few (one per bucket pair) and are built once per process.

Rows below MIN_PAIRS query-key pairs keep SDPA's flash path (cheaper than two calls and
a merge there). tests/test_flex_prefill.py checks the split, padding and merge against
the torch reference backend on CPU (with float32 math as the dense kernel) and, under
-m gpu, cuDNN's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

MIN_PAIRS = 1 << 23
"""Query-key pairs (N * (P + N / 2)) from which a prefill row takes this path: at 8M the
split path beat flash in the one-layer timings (16K prefix x 512 new: 0.61 vs 0.74 ms;
2K x 512: 0.52 vs 0.16 ms, two calls and a merge for little work)."""

KV_GRAIN = 2048
"""The bulk part's key counts are multiples of this: the tail (< KV_GRAIN keys, whose
zero query rows cost at most KV_GRAIN^2 / 2 pairs more) keeps the plans few."""

Dense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], Any]
"""dense(q [S, Hq, D], k [Sk, Hkv, D], v, causal (upper-left), scale) -> (out [S, Hq, D],
lse [Hq, S] float32, natural log)."""


@dataclass(frozen=True)
class Split:
    """The shapes one long prefill row runs at (see the module docstring)."""

    bulk: int  # P_a: prefix keys of part A (0: no part A)
    tail: int  # P_b: prefix keys of part B
    rows: int  # part A's query rows, N padded
    square: int  # part B's size, P_b + N padded


def bucket(n: int) -> int:
    """n rounded up to one of 8 sizes per power of two (at most 1/8 more, >= 64 steps)."""
    grain = max(64, (1 << (n.bit_length() - 1)) >> 3)
    return -(-n // grain) * grain


def plan(prefix: int, new: int) -> Split:
    bulk = prefix // KV_GRAIN * KV_GRAIN
    tail = prefix - bulk
    return Split(bulk, tail, bucket(new), bucket(tail + new))


def wanted(prefix: int, new: int, min_pairs: float = MIN_PAIRS) -> bool:
    """True when a row of `new` tokens behind `prefix` cached ones has at least
    `min_pairs` query-key pairs (about new * (prefix + new / 2))."""
    return new * (prefix + new / 2) >= min_pairs


def usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """cuDNN's attention applies: CUDA, a 16-bit cache of q's dtype, head dim 64 or 128,
    cuDNN 9 or later."""
    if q.device.type != "cuda" or kv_cache.dtype != q.dtype:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if q.shape[1] % kv_cache.shape[3]:
        return False
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return version is not None and version >= 90000


def _bhsd(x: torch.Tensor) -> torch.Tensor:  # [S, H, D] -> [1, H, S, D] view
    return x.transpose(0, 1).unsqueeze(0)


def cudnn_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention with its LSE; K/V with fewer heads than q (GQA) as they are."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale
    )
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0])


def math_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in float32 torch ops (tests on CPU)."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if causal:
        upper = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    return out.to(q.dtype), lse


def prefill(
    q: torch.Tensor,  # [N, Hq, D] the row's queries
    k: torch.Tensor,  # [N, Hkv, D] its new keys (already in the cache too)
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    blocks: torch.Tensor,  # the row's block table (at least ceil(prefix / block_size))
    prefix: int,
    scale: float,
    dense: Dense = cudnn_dense,
) -> torch.Tensor:  # [N, Hq, D]
    """Causal attention of N new tokens over `prefix` cached tokens + themselves."""
    new, _, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    split = plan(prefix, new)
    kv = None
    if prefix:
        ids = blocks[: -(-prefix // block_size)]
        kv = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, ids)
        kv = kv.view(2, -1, num_kv_heads, head_dim)
    # B: [zero rows for the tail | q | zero rows] over [tail | new | zero keys], causal.
    end = split.tail + new
    q_b = F.pad(q, (0, 0, 0, 0, split.tail, split.square - end))
    kv_b = q.new_empty(2, split.square, num_kv_heads, head_dim)
    if split.tail:
        assert kv is not None
        kv_b[:, : split.tail] = kv[:, split.bulk : prefix]
    kv_b[0, split.tail : end] = k
    kv_b[1, split.tail : end] = v
    kv_b[:, end:] = 0  # seen by dropped rows only, but 0 * NaN would spread
    o_b, lse_b = dense(q_b, kv_b[0], kv_b[1], True, scale)
    if not split.bulk:
        return o_b[split.tail : end]
    assert kv is not None
    q_a = F.pad(q, (0, 0, 0, 0, 0, split.rows - new))
    o_a, lse_a = dense(q_a, kv[0, : split.bulk], kv[1, : split.bulk], False, scale)
    return merge(o_a, lse_a, 0, o_b, lse_b, split.tail, new)


def merge(
    o_a: torch.Tensor,  # [Sa, H, D]
    lse_a: torch.Tensor,  # [H, Sa] float32
    row_a: int,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    row_b: int,
    n: int,
) -> torch.Tensor:  # [n, H, D]
    """Rows row_a.. of A and row_b.. of B (attention over disjoint keys) as one result:
    out = (e^(lse_a - m) o_a + e^(lse_b - m) o_b) / (e^(lse_a - m) + e^(lse_b - m))."""
    if o_a.device.type == "cuda" and o_a.shape[2] in (64, 128):
        out = o_a.new_empty(n, o_a.shape[1], o_a.shape[2])
        lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
        grid = (-(-n // 64), o_a.shape[1])
        _merge_kernel()[grid](
            out,
            o_a[row_a:],
            lse_a[:, row_a:],
            o_b[row_b:],
            lse_b[:, row_b:],
            n,
            o_a.stride(0),
            o_a.stride(1),
            o_b.stride(0),
            o_b.stride(1),
            out.stride(0),
            out.stride(1),
            lse_a.stride(0),
            lse_b.stride(0),
            D=o_a.shape[2],
            BLOCK_T=64,
            num_warps=4,
        )
        return out
    la, lb = lse_a[:, row_a : row_a + n].t(), lse_b[:, row_b : row_b + n].t()  # [n, H]
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    a, b = o_a[row_a : row_a + n].float(), o_b[row_b : row_b + n].float()
    out = a * (wa / total).unsqueeze(-1) + b * (wb / total).unsqueeze(-1)
    return out.to(o_a.dtype)


@functools.cache
def _merge_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def merge_rows(
        out,
        oa,
        la,
        ob,
        lb,
        n,
        sa_t,
        sa_h,
        sb_t,
        sb_h,
        so_t,
        so_h,
        la_h,
        lb_h,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        h = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        keep = t < n
        d = tl.arange(0, D)
        lse_a = tl.load(la + h * la_h + t, mask=keep, other=0.0)
        lse_b = tl.load(lb + h * lb_h + t, mask=keep, other=0.0)
        m = tl.maximum(lse_a, lse_b)
        wa = tl.exp(lse_a - m)
        wb = tl.exp(lse_b - m)
        inv = 1.0 / (wa + wb)
        a = tl.load(oa + t[:, None] * sa_t + h * sa_h + d[None, :], mask=keep[:, None])
        b = tl.load(ob + t[:, None] * sb_t + h * sb_h + d[None, :], mask=keep[:, None])
        o = a.to(tl.float32) * (wa * inv)[:, None] + b.to(tl.float32) * (wb * inv)[:, None]
        dst = out + t[:, None] * so_t + h * so_h + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=keep[:, None])

    return merge_rows

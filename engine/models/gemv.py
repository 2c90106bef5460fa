"""One-row matmuls (GEMV) of a decode step at batch 1, with the glue around them fused in.

At batch 1 a decode step is a stream of weight reads: every matmul is a [1, K] x [K, N]
GEMV, and a step is as fast as the weights stream from memory. Kernels that fuse a
prologue into their loads (inductor's, with the RMSNorm or the SwiGLU computed per tile)
read the weights well below the copy bandwidth, and every glue kernel left between them
costs a few microseconds per layer. This kernel keeps the weight stream plain and moves
the glue where it costs nothing:

    RMSNorm before the matmul:  y = rsqrt(mean(x^2) + eps) * (W (norm_w * x))
        the sum of squares accumulates in the same loop that reads x (every program
        reads all of x), the scale applies to the N outputs, not the K inputs;
    pairs of rows (gate|up, RoPE): a program reads rows r and r + HALF of each segment
        of SEG rows together, so an epilogue can combine them:
        SwiGLU (gate|up, SEG = N):  out[r] = silu(gate[r]) * up[r]        (N / 2 outputs)
        RoPE (q|k|v, SEG = D):      (a, b) -> (a cos - b sin, b cos + a sin) on the
                                    rows of q and k, v passed through
    bias, residual add:         on the N outputs.

Outputs are rounded to the weight's dtype where a torch matmul would round them (the
matmul's result, then each elementwise step as one rounding), so bf16 results stay within
rounding of the eager ops and float32 results match them to float precision.

Block sizes are chosen per weight shape and mode by timing a few candidates the first time
a shape runs (outside any CUDA graph capture: the engine's warm-up runs first), each with
the L2 cache flushed (triton.testing.do_bench), so a weight smaller than the L2 is timed as
the decode step reads it: cold. tests/test_gemv.py checks every mode against torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from engine.triton_support import triton_runs_on


@dataclass(frozen=True)
class Config:
    """Rows per program (per half with pairs), K per loop iteration, warps, stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


CANDIDATES = (
    Config(8, 256, 4, 3),
    Config(4, 512, 4, 3),
    Config(16, 128, 4, 3),
    Config(8, 512, 8, 2),
    Config(16, 256, 8, 2),
    Config(2, 1024, 4, 2),
    Config(4, 1024, 8, 2),
    Config(32, 128, 8, 2),
    Config(16, 512, 8, 1),
)
"""The block shapes timed per weight shape; small rows-per-program first, so that narrow
weights (4096 outputs) still fill the GPU's 132 multiprocessors several times."""

TIMED_BYTES = 4 << 20
"""Weights smaller than this take the first fitting block shape untimed (each candidate
compiles a kernel: seconds, not worth it for a weight read in microseconds)."""

_CHOSEN: dict[tuple[Any, ...], Config] = {}
"""The timed choice per (N, K, mode, dtype)."""


def usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True when the kernel can run one row x [1, K] through `weights`: CUDA (or Triton's
    interpreter on CPU, for tests), contiguous weights of one floating dtype."""
    if x.dim() != 2 or x.shape[0] != 1:
        return False
    if not triton_runs_on(x.device):
        return False
    return all(w.is_contiguous() and w.dtype == x.dtype for w in weights)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(
        x,
        w,
        out,
        norm_w,
        bias,
        res,
        cos,
        sin,
        eps,
        rope_rows,
        K: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        RES: tl.constexpr,
        PAIR: tl.constexpr,  # 0: plain rows; 1: SwiGLU over gate|up; 2: RoPE over q|k|v
        HALF: tl.constexpr,
        SEG: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK_N)
        if PAIR == 0:
            rows = pid * BLOCK_N + lanes
        else:
            per_seg = HALF // BLOCK_N
            rows = (pid // per_seg) * SEG + (pid % per_seg) * BLOCK_N + lanes
        rows = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        w_a = w + rows[:, None] * K + cols[None, :]
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xk = tl.load(x + k0 + cols).to(tl.float32)
                wa = tl.load(w_a + k0, eviction_policy="evict_first")
            else:
                kmask = k0 + cols < K
                xk = tl.load(x + k0 + cols, mask=kmask, other=0.0).to(tl.float32)
                wa = tl.load(
                    w_a + k0, mask=kmask[None, :], other=0.0, eviction_policy="evict_first"
                )
            if NORM:
                squares += xk * xk
                if EVEN_K:
                    xk = xk * tl.load(norm_w + k0 + cols).to(tl.float32)
                else:
                    xk = xk * tl.load(norm_w + k0 + cols, mask=kmask, other=0.0).to(tl.float32)
            acc_a += wa.to(tl.float32) * xk[None, :]
            if PAIR != 0:
                if EVEN_K:
                    wb = tl.load(w_a + HALF * K + k0, eviction_policy="evict_first")
                else:
                    wb = tl.load(
                        w_a + HALF * K + k0,
                        mask=kmask[None, :],
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                acc_b += wb.to(tl.float32) * xk[None, :]
        dtype = out.dtype.element_ty
        ya = tl.sum(acc_a, axis=1)
        scale = 1.0
        if NORM:
            scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
            ya = ya * scale
        if BIAS:
            ya += tl.load(bias + rows).to(tl.float32)
        ya = ya.to(dtype).to(tl.float32)  # the matmul's output, rounded
        if PAIR == 0:
            if RES:
                ya = tl.load(res + rows).to(tl.float32) + ya
            tl.store(out + rows, ya.to(dtype))
        else:
            yb = tl.sum(acc_b, axis=1)
            if NORM:
                yb = yb * scale
            if BIAS:
                yb += tl.load(bias + rows + HALF).to(tl.float32)
            yb = yb.to(dtype).to(tl.float32)
            if PAIR == 1:
                # silu(gate) rounded as torch's F.silu output, then * up
                act = (ya / (1.0 + tl.exp(-ya))).to(dtype).to(tl.float32) * yb
                tl.store(out + rows, act.to(dtype))
            else:
                dim = (pid % per_seg) * BLOCK_N + lanes  # position inside the first half
                c1 = tl.load(cos + dim).to(tl.float32)
                s1 = tl.load(sin + dim).to(tl.float32)
                c2 = tl.load(cos + dim + HALF).to(tl.float32)
                s2 = tl.load(sin + dim + HALF).to(tl.float32)
                rotate = (pid // per_seg) * SEG < rope_rows  # q and k heads, not v
                oa = tl.where(rotate, ya * c1 - yb * s1, ya)
                ob = tl.where(rotate, yb * c2 + ya * s2, yb)
                tl.store(out + rows, oa.to(dtype))
                tl.store(out + rows + HALF, ob.to(dtype))

    return gemv_kernel


def _fits(cfg: Config, rows: int) -> bool:
    return rows % cfg.block_n == 0


def gemv(
    x: torch.Tensor,  # [1, K]
    w: torch.Tensor,  # [N, K]
    *,
    norm: torch.Tensor | None = None,  # [K]: RMSNorm x first (weight norm, epsilon eps)
    eps: float = 0.0,
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [1, N]: added to the output
    swiglu: bool = False,  # w is gate|up [2 I, K]: out [1, I] = silu(gate) * up
    rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] (usable(x, w) must hold) -> [1, N] in w's dtype: w @ x with the options
    fused in. `rope` = (cos [D], sin [D], rope_rows, D): rows [0, rope_rows) are heads of D
    dims rotated in the rotate-half convention (engine/rope.py), the rest (v) passed
    through; N and rope_rows multiples of D. Raises ValueError for shapes no block size
    divides (callers check `supports` first)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns for a [{n}, {k}] weight")
    pair, half, seg = 0, n, n
    if swiglu:
        pair, half, seg = 1, n // 2, n
    elif rope is not None:
        pair, half, seg = 2, rope[3] // 2, rope[3]
    if not supports(n, pair, half, seg):
        raise ValueError(f"no block size fits a [{n}, {k}] weight in mode {pair}")
    x = x.contiguous()
    out = torch.empty(1, n // 2 if swiglu else n, device=x.device, dtype=w.dtype)
    cos, sin, rope_rows = (x, x, 0) if rope is None else rope[:3]
    key = (n, k, pair, half, norm is not None, bias is not None, residual is not None, w.dtype)

    def launch(cfg: Config) -> None:
        rows = half if pair else n
        grid = ((n // seg) * (rows // cfg.block_n if pair else n // cfg.block_n),)
        _kernel()[grid](
            x,
            w,
            out,
            x if norm is None else norm,
            x if bias is None else bias,
            x if residual is None else residual.contiguous(),
            cos,
            sin,
            eps,
            rope_rows,
            K=k,
            NORM=norm is not None,
            BIAS=bias is not None,
            RES=residual is not None,
            PAIR=pair,
            HALF=half,
            SEG=seg,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.warps,
            num_stages=cfg.stages,
        )

    small = w.numel() * w.element_size() < TIMED_BYTES
    launch(_choose(key, half if pair else n, x.device, launch, timed=not small))
    return out


def fits(n: int, *, swiglu: bool = False, head_dim: int | None = None) -> bool:
    """Whether gemv takes a weight of N rows in that mode (some block size divides the
    rows a program covers; pairs of rows need an even split)."""
    if swiglu:
        return n % 2 == 0 and supports(n, 1, n // 2, n)
    if head_dim is not None:
        return head_dim % 2 == 0 and supports(n, 2, head_dim // 2, head_dim)
    return supports(n, 0, n, n)


def supports(n: int, pair: int, half: int, seg: int) -> bool:
    """Whether some candidate block divides the rows a program covers."""
    if pair and (seg != 2 * half or n % seg):
        return False
    return any(_fits(c, half if pair else n) for c in CANDIDATES)


def _choose(
    key: tuple[Any, ...], rows: int, device: torch.device, launch: Any, timed: bool
) -> Config:
    """The candidate that ran fastest for `key` (timed on first use); the first fitting
    one where timing is impossible (CPU interpreter, inside a CUDA graph capture) or not
    worth it (`timed` false: a weight far smaller than the GPU's L2)."""
    if key in _CHOSEN:
        return _CHOSEN[key]
    fitting = [c for c in CANDIDATES if _fits(c, rows)]
    if not timed or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return fitting[0]
    from triton.testing import do_bench

    best, best_ms = fitting[0], float("inf")
    for cfg in fitting:
        try:
            ms = do_bench(functools.partial(launch, cfg), warmup=5, rep=20)
        except Exception:  # a block shape this GPU cannot run (resources): skip it
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _CHOSEN[key] = best
    return best


def chosen() -> dict[str, str]:
    """The timed choices so far, readable (benchmarks print them)."""
    return {
        f"N={k[0]} K={k[1]} mode={k[2]}": f"{c.block_n}x{c.block_k} w{c.warps} s{c.stages}"
        for k, c in _CHOSEN.items()
    }

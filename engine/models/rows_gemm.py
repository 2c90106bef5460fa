"""Matmuls of decode steps with 2-64 rows: a Triton GEMM with narrow and split-K tiles.

At a few dozen rows a decode step's matmuls still stream their weights (an 8B model: 15
GB per step), and cuBLAS' tiles can leave multiprocessors idle on the narrower weights:
at 32 rows a [4096, 4096] o weight read at ~2.5 TB/s on an H200. This kernel gives the
weight rows the MMA's M side ("swap AB": out^T = W x^T, the activations' rows are the
MMA's N, 16-64 of them) and splits K when the output tiles alone do not fill the GPU:

    grid (N / BN, SPLIT): program (n, s) multiplies W[n*BN : (n+1)*BN, K_s] by x[:, K_s]
        where K_s is the s-th of SPLIT equal runs of BK-wide K tiles (SPLIT divides them)
    SPLIT = 1: the program writes its [BM, BN] tile of out
    SPLIT > 1: each program writes its float32 partial to a workspace, then counts
        itself in on the tile's lock (atomic add, acquire-release); the last of the
        SPLIT to arrive sums the SPLIT partials in split order (deterministic) and
        writes the tile, and resets the lock to 0 for the next launch

The locks are one int32 per output tile, per device, allocated once (zeros) outside
any CUDA graph capture; launches of this kernel on one device must not overlap (the
engine runs its steps on one stream).

Which tiling (or cuBLAS) runs is chosen per (row class, N, K, dtype) by timing every
candidate the first time a shape runs, outside any CUDA graph capture, with the L2
flushed between calls (triton.testing.do_bench), so weights are read cold as in a step
over 32 layers; cuBLAS (F.linear) is a candidate too, which a tiling must beat by a
margin (MARGIN). Row classes are powers of two from 16 to MAX_ROWS (the tile's activation side).
tests/test_rows_gemm.py checks every candidate against torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.triton_support import triton_runs_on


@dataclass(frozen=True)
class Config:
    """Weight rows per program (BN), K per loop iteration (BK), K splits, warps, stages."""

    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


CANDIDATES = (
    Config(64, 64, 1, 4, 4),
    Config(128, 64, 1, 4, 4),
    Config(64, 64, 2, 4, 4),
    Config(128, 64, 4, 4, 4),
    Config(64, 128, 4, 4, 3),
)
"""The tilings timed per shape (with cuBLAS): plain tiles for wide weights (gate|up,
lm_head), split ones for the 4096-row weights (o, down). On an H200 (docs/benchmarks.md)
these won some 32-row shapes (o, down, lm_head, by 1-5%); at 128 rows cuBLAS won every
shape, so there the choice is cuBLAS; wider (256-row) and 8-warp tiles never won."""

CUBLAS = None
"""The choice meaning F.linear (cuBLAS)."""

MAX_ROWS = 64
"""Steps of more rows than this keep cuBLAS: at 128 rows cuBLAS beat every tiling here on
an H200 (its kernels share activation tiles across a cluster; these reload them per
program, as much L2 traffic as the weights at 128 weight rows per program), and prefill
is compute-bound."""

MARGIN = 0.97
"""A tiling replaces cuBLAS only if it times under MARGIN x cuBLAS' time: the start-up
timings vary by a few percent run to run, and a noisy win is no win (an 8B model's
down weight at 128 rows once chose a split tiling 20% slower in isolation)."""

MAX_TILES = 1 << 14
"""Output tiles per launch the lock buffer covers (128256-row lm_head at BN 64: 2004)."""

_CHOSEN: dict[tuple[Any, ...], Config | None] = {}
"""The timed choice per (row class, N, K, dtype); None: cuBLAS."""

_LOCKS: dict[torch.device, torch.Tensor] = {}


def row_class(rows: int) -> int:
    """The activation side of the tile for `rows` rows: a power of two, at least 16."""
    return max(16, 1 << (rows - 1).bit_length())


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the kernel can run x [M, K] through w [N, K]: 2 <= M <= MAX_ROWS, one
    16-bit dtype, w contiguous, x's rows contiguous, N a multiple of 64 and K of 64;
    CUDA, or Triton's interpreter on CPU (tests)."""
    if x.dim() != 2 or w.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if not triton_runs_on(x.device):
        return False
    n, k = w.shape
    return (
        n % 64 == 0 and k % 64 == 0 and x.shape[1] == k and w.is_contiguous() and x.stride(1) == 1
    )


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rows_gemm_kernel(
        x,
        w,
        out,
        ws,
        locks,
        M,
        N,
        stride_xm,
        K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        SPLIT: tl.constexpr,
        STEPS: tl.constexpr,  # K tiles per split: K / BK / SPLIT
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_offs = pid_n * BN + tl.arange(0, BN)
        m_offs = tl.arange(0, BM)
        k_offs = tl.arange(0, BK)
        k_lo = pid_k * (STEPS * BK)
        w_ptr = w + n_offs[:, None].to(tl.int64) * K + k_lo + k_offs[None, :]
        x_ptr = x + m_offs[:, None] * stride_xm + k_lo + k_offs[None, :]
        m_mask = m_offs[:, None] < M
        acc = tl.zeros([BN, BM], dtype=tl.float32)  # out^T tile: weight rows x activation rows
        for t in range(0, STEPS):
            wt = tl.load(w_ptr + t * BK, eviction_policy="evict_first")
            xt = tl.load(x_ptr + t * BK, mask=m_mask, other=0.0)
            acc = tl.dot(wt, tl.trans(xt), acc)
        out_ptr = out + m_offs[:, None] * N + n_offs[None, :]
        dtype = out.dtype.element_ty
        if SPLIT == 1:
            tl.store(out_ptr, tl.trans(acc).to(dtype), mask=m_mask)
        else:
            tile = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
            n_tiles = N // BN
            tl.store(ws + (pid_k * n_tiles + pid_n) * (BN * BM) + tile, acc)
            tl.debug_barrier()  # every thread's partial stored before the count
            arrived = tl.atomic_add(locks + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = tl.zeros([BN, BM], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    part = ws + (s * n_tiles + pid_n) * (BN * BM) + tile
                    total += tl.load(part, cache_modifier=".cg")
                tl.store(out_ptr, tl.trans(total).to(dtype), mask=m_mask)
                tl.atomic_xchg(locks + pid_n, 0)

    return rows_gemm_kernel


def _locks(device: torch.device) -> torch.Tensor:
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _LOCKS[device]


def fits(cfg: Config, n: int, k: int) -> bool:
    """Whether `cfg` tiles a [n, k] weight (whole tiles on N and K, the K tiles split
    evenly, the lock buffer large enough)."""
    return (
        n % cfg.block_n == 0
        and k % cfg.block_k == 0
        and (k // cfg.block_k) % cfg.split == 0
        and n // cfg.block_n <= MAX_TILES
    )


def launch(x: torch.Tensor, w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype through the kernel tiled by `cfg`
    (usable(x, w) and fits(cfg, N, K) must hold)."""
    m, k = x.shape
    n = w.shape[0]
    bm = row_class(m)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    n_tiles = n // cfg.block_n
    ws = out
    if cfg.split > 1:
        ws = torch.empty(
            cfg.split * n_tiles * cfg.block_n * bm, device=x.device, dtype=torch.float32
        )
    _kernel()[(n_tiles, cfg.split)](
        x,
        w,
        out,
        ws,
        _locks(x.device),
        m,
        n,
        x.stride(0),
        K=k,
        BM=bm,
        BN=cfg.block_n,
        BK=cfg.block_k,
        SPLIT=cfg.split,
        STEPS=k // cfg.block_k // cfg.split,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N]: the tiling timed fastest for this shape (or
    cuBLAS), F.linear wherever the kernel does not apply."""
    if x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    if not usable(x, w):
        return F.linear(x, w)
    n, k = w.shape
    key = (row_class(x.shape[0]), n, k, x.dtype)
    cfg = _choose(key, x, w)
    return F.linear(x, w) if cfg is CUBLAS else launch(x, w, cfg)


def _choose(key: tuple[Any, ...], x: torch.Tensor, w: torch.Tensor) -> Config | None:
    """The fastest of cuBLAS and the fitting candidates for `key` (a candidate must beat
    cuBLAS by MARGIN), timed on first use;
    cuBLAS where timing is impossible (CPU interpreter, inside a CUDA graph capture:
    the lock buffer is not allocated there either)."""
    if key in _CHOSEN:
        return _CHOSEN[key]
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return CUBLAS
    from triton.testing import do_bench

    _locks(x.device)
    n, k = w.shape
    best: Config | None = CUBLAS
    best_ms = MARGIN * do_bench(lambda: F.linear(x, w), warmup=5, rep=20)
    for cfg in CANDIDATES:
        if not fits(cfg, n, k):
            continue
        try:
            ms = do_bench(functools.partial(launch, x, w, cfg), warmup=5, rep=20)
        except Exception:  # a tiling this GPU cannot run (shared memory): skip it
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _CHOSEN[key] = best
    return best


def chosen() -> dict[str, str]:
    """The timed choices so far, readable (benchmarks print them)."""
    return {
        f"rows<={k[0]} N={k[1]} K={k[2]}": (
            "cublas"
            if c is None
            else f"{c.block_n}x{c.block_k} split {c.split} w{c.warps} s{c.stages}"
        )
        for k, c in _CHOSEN.items()
    }


@torch.library.custom_op("kvserve::rows_matmul", mutates_args=())
def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`matmul` as an op torch.compile keeps whole (its choice runs in Python at call
    time: during the warm-up and capture of a decode graph, not at every replay)."""
    return matmul(x, w)


@rows_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's signature over rows_matmul (layer_ops' glue for 2..MAX_ROWS-row steps)."""
    out = torch.ops.kvserve.rows_matmul(x, w)
    return out if b is None else out + b

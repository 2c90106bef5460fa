"""LayerOps: the element-wise parts of a Llama decoder layer, eager or fused by torch.compile.

A decoder layer is 3 matmuls-with-glue plus attention. At decode batch sizes the glue
(RMSNorm in float32, RoPE, residual adds, SwiGLU: ~20 small kernels per layer) costs more
than its bytes: each kernel is a few microseconds even replayed from a CUDA graph, ~2.8
ms per step of an 8B model. The three functions below are that glue around the matmuls;
torch.compile (inductor, Triton kernels on CUDA) fuses each into ~2 kernels and calls
cuBLAS for the matmuls:

    attn_in:   x -> RMSNorm -> qkv matmul -> (q|k RMSNorm) -> RoPE       -> q, k, v
               (RoPE left to the attention backend's cache write where it takes it)
    attn_out:  x, attn -> o matmul -> + x -> RMSNorm                     -> x, h
    mlp:       x, h -> gate|up matmul -> silu(gate) * up -> down matmul -> + x
    norm:      the final RMSNorm;  logits: lm_head matmul (-> float32)

EAGER runs them as written (the CPU path and the float32 reference: token-identical to
transformers); `compiled()` gives the fused versions (CUDA engines with decode graphs,
EngineConfig.compile_layers). One compiled function serves every layer (weights are
arguments, not attributes: no recompile per layer) and every batch size: the first call
compiles for its T, the second (another T) for a symbolic T (torch.compile's automatic
dynamic shapes; weight shapes stay static, so reductions keep their fixed-size kernels).

One-row steps (T = 1, decode at batch 1: torch.compile always specializes a size of 1)
are a stream of weight reads, and their matmuls are GEMVs. By default (ONE_ROW =
"triton") they run engine/models/gemv.py's kernel, which keeps the weight stream plain and
fuses the glue where it costs nothing: q|k|v with the RMSNorm (its scale applied to the
outputs) and RoPE (pairs of rows), o with the residual add, gate|up with the post-attention
RMSNorm and the SwiGLU (pairs of rows), down with the residual add; `post_attn` runs o +
norm + MLP so that the norm needs no kernel of its own. Where that kernel does not apply
(q|k norms, partial rotary) and under ONE_ROW = "inductor", they compile with inductor's
coordinate-descent tuning, under which inductor writes a [1, K] x [K, N] matmul as a
multiply-and-sum reduction it generates and tunes itself, with the glue fused into its
loads, instead of calling cuBLAS, whose kernels for that shape read the weights below the
copy bandwidth (benchmarks/gpu_engine.py, docs/benchmarks.md).

Steps of 2 to rows_gemm.MAX_ROWS (64) rows in 16 bits (decode at batch 2-64) compile
their glue around engine/models/rows_gemm.py's matmul (MANY_ROWS = "triton", the default):
per weight shape and row class, the fastest of cuBLAS and a Triton GEMM with narrow or
split-K tiles, timed on first use (the decode graphs' warm-up). Larger steps keep cuBLAS,
which beat every such tiling at 128 rows (docs/benchmarks.md), and add their residuals
without device copies (COPY_FREE_RESIDUALS).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models import gemv as row_gemv
from engine.models import rows_gemm
from engine.models.cpu_gemm import linear
from engine.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D]; computed in float32 and cast back before the weight, as HF does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def glue(lin: Any, wide: bool = False) -> tuple[Any, Any, Any]:
    """attn_in, attn_out and mlp multiplying through `lin`: cpu_gemm.linear for EAGER (a
    weight's packed copy on CPU, else F.linear), F.linear for the compiled versions (CUDA
    weights are never packed, and the packed-copy lookup is not something to trace).
    `wide`: attn_out for the general compilation (COPY_FREE_RESIDUALS)."""

    def attn_in(
        x: torch.Tensor,  # [T, H]
        norm_w: torch.Tensor,
        qkv_w: torch.Tensor,
        qkv_b: torch.Tensor | None,
        qk_norm_w: torch.Tensor | None,
        cos: torch.Tensor,  # [T, 1, R]
        sin: torch.Tensor,
        eps: float,
        hq: int,
        hkv: int,
        rotate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        """rotate=False: q and k returned unrotated (views of the projection's output: the
        attention backend rotates them as it writes the cache, AttentionBackend.
        rotates_on_write)."""
        num_tokens = x.shape[0]
        d = qkv_w.shape[0] // (hq + 2 * hkv)
        h = rms_norm(x, norm_w, eps)
        qkv = lin(h, qkv_w, qkv_b)  # [T, (Hq+2Hkv) D]
        qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)  # [T, Hq+Hkv, D]
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)  # [T, Hkv, D]
        if qk_norm_w is not None:
            qk = rms_norm(qk, qk_norm_w, eps)
        if rotate:
            qk = apply_rotary(qk, cos, sin)  # q and k rotated in one pass
        return qk[:, :hq], qk[:, hq:], v

    def attn_out(
        x: torch.Tensor,  # [T, H] residual stream
        attn: torch.Tensor,  # [T, Hq, D]
        o_w: torch.Tensor,
        norm_w: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new residual x, normed h [T, H]
        o = lin(attn.reshape(x.shape[0], -1), o_w)
        # wide: the same rounded sum, kept out of inductor's mm + add -> addmm rewrite
        x = (x.float() + o.float()).to(x.dtype) if wide else x + o
        return x, rms_norm(x, norm_w, eps)

    def mlp(
        x: torch.Tensor,  # [T, H] residual stream
        h: torch.Tensor,  # [T, H] normed
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
    ) -> torch.Tensor:  # [T, H]
        return x + lin(swiglu_of(lin)(h, gate_up_w), down_w)

    return attn_in, attn_out, mlp


def swiglu_of(lin: Any) -> Any:
    """h, gate_up_w -> silu(gate) * up [T, I], multiplying through `lin`."""

    def swiglu(h: torch.Tensor, gate_up_w: torch.Tensor) -> torch.Tensor:
        gate, up = lin(h, gate_up_w).chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up

    return swiglu


def head(lin: Any) -> tuple[Any, Any]:
    """The final RMSNorm and the lm_head matmul through `lin` (float32 logits; with
    `float32=False` in the model's dtype, the matmul's own output)."""

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def logits(h: torch.Tensor, lm_head: torch.Tensor, float32: bool = True) -> torch.Tensor:
        out = lin(h, lm_head)  # [N, H] -> [N, V]
        return out.float() if float32 else out

    return norm, logits


@dataclass(frozen=True)
class LayerOps:
    """The functions a LlamaDecoderLayer calls around attention (attn_in, attn_out, mlp)
    and the model calls after the last layer (norm, logits). `post_attn` (None: attn_out
    then mlp), when set, replaces attn_out + mlp on dense layers:
    post_attn(x, attn, o_w, norm_w, gate_up_w, down_w, eps) -> the layer's output."""

    attn_in: Any
    attn_out: Any
    mlp: Any
    norm: Any
    logits: Any
    fused: bool = False
    post_attn: Any = None


EAGER = LayerOps(*glue(linear), *head(linear))

_COMPILED: tuple[tuple[frozenset[str], str, str, bool], LayerOps] | None = None


GEMV_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}
"""Inductor options of the one-row (T = 1) compilations: under coordinate-descent tuning
inductor decomposes a matmul with one row into a reduction it generates (its `mm`
decomposition) and tunes that kernel's block sizes by measuring them."""


GEMV_OPS = frozenset({"attn_in", "attn_out", "mlp", "logits"})
"""The ops whose one-row steps go through inductor's GEMV by default (the others keep
cuBLAS for them)."""


ONE_ROW = "triton"
"""How one-row steps run the ops of GEMV_OPS: "triton" (engine/models/gemv.py: q|k|v with
the RMSNorm and RoPE fused in, o with the residual add, gate|up with the RMSNorm and SwiGLU,
down with the residual add: 4 kernels and no glue kernel per layer; inductor's GEMV where
those kernels do not apply) or "inductor" (inductor's GEMV with its fusions)."""


MANY_ROWS = "triton"
"""How 16-bit CUDA steps of 2 to rows_gemm.MAX_ROWS (64) rows run their matmuls: "triton"
(engine/models/rows_gemm.py: per shape the timed fastest of its tilings and cuBLAS) or
"cublas" (F.linear, inductor's extern call)."""


COPY_FREE_RESIDUALS = True
"""Steps of the general compilation (more than rows_gemm.MAX_ROWS rows: decode buckets of
80-128 rows, prefill) add their residuals without a device copy. Left alone, inductor
rewrites `x + mm` into cuBLAS' addmm (the sum in the GEMM's epilogue), which ATen runs
as a copy of x into the output and a GEMM adding onto it: two device copies per layer,
~2 us each with their gaps at 128 rows. Instead o's residual sum is written so that
inductor leaves it to the RMSNorm kernel after it (the same bf16 rounding), and the
MLP's down GEMM adds onto x in place (`x.addmm_`, outside the compiled glue: x is
attn_out's fresh output, read by nothing else)."""


TUNE_ROWS: frozenset[int] = frozenset()
"""Decode batch buckets whose steps compile with inductor's max-autotune (TUNED_OPTIONS),
which times its Triton matmul templates against cuBLAS per shape and keeps the faster.
Empty by default: at 128 rows the templates it chose (5-10% faster than cuBLAS in its own
timing, which reuses one weight from L2) made the 8B model's decode step no faster
(10.15 against 9.96 ms, docs/benchmarks.md) and tuning costs ~40 s at start-up. Tuning
happens at graph capture (`tune`), never mid-serving."""

TUNED_OPTIONS: dict[str, Any] = {"max_autotune": True}

_tuned_rows: set[int] = set()
"""Row counts whose 16-bit steps run the autotuned compilation (filled by `tune`)."""


def tune(rows: int) -> None:
    """From now on steps of `rows` rows (16-bit activations) run the autotuned
    compilation, if `rows` is in TUNE_ROWS. DecodeGraphs calls this for each bucket before
    its warm-up step, which compiles (and tunes) that shape before the graph is captured."""
    if rows in TUNE_ROWS:
        _tuned_rows.add(rows)


def untune() -> None:
    """Back to the general compilation for every row count (benchmarks compare)."""
    _tuned_rows.clear()


def triton_one_row(attn_in: Any, attn_out: Any, mlp: Any) -> tuple[Any, Any]:
    """attn_in and post_attn for one-row steps through engine/models/gemv.py; the given
    (inductor) functions run where it does not apply (q|k RMSNorm, partial rotary, a
    device or dtype the kernel does not take, shapes no block size divides)."""

    def one_attn_in(
        x: torch.Tensor,
        norm_w: torch.Tensor,
        qkv_w: torch.Tensor,
        qkv_b: torch.Tensor | None,
        qk_norm_w: torch.Tensor | None,
        cos: torch.Tensor,  # [1, 1, R]
        sin: torch.Tensor,
        eps: float,
        hq: int,
        hkv: int,
        rotate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = qkv_w.shape[0]
        d = n // (hq + 2 * hkv)
        if not rotate:
            return attn_in(x, norm_w, qkv_w, qkv_b, qk_norm_w, cos, sin, eps, hq, hkv, rotate)
        if (
            qk_norm_w is None
            and cos.shape[-1] == d
            and row_gemv.usable(x, qkv_w, norm_w, cos, sin)
            and row_gemv.fits(n, head_dim=d)
        ):
            qkv = row_gemv.gemv(
                x,
                qkv_w,
                norm=norm_w,
                eps=eps,
                bias=qkv_b,
                rope=(cos.reshape(-1), sin.reshape(-1), (hq + hkv) * d, d),
            )
            q = qkv[:, : hq * d].view(1, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(1, hkv, d)
            return q, k, qkv[:, (hq + hkv) * d :].view(1, hkv, d)
        return attn_in(x, norm_w, qkv_w, qkv_b, qk_norm_w, cos, sin, eps, hq, hkv)

    def one_post_attn(
        x: torch.Tensor,
        attn: torch.Tensor,  # [1, Hq, D]
        o_w: torch.Tensor,
        norm_w: torch.Tensor,
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        flat = attn.reshape(1, -1)
        if (
            row_gemv.usable(x, o_w, norm_w, gate_up_w, down_w)
            and row_gemv.usable(flat)
            and row_gemv.fits(o_w.shape[0])
            and row_gemv.fits(gate_up_w.shape[0], swiglu=True)
            and row_gemv.fits(down_w.shape[0])
        ):
            x = row_gemv.gemv(flat, o_w, residual=x)
            act = row_gemv.gemv(x, gate_up_w, norm=norm_w, eps=eps, swiglu=True)
            return row_gemv.gemv(act, down_w, residual=x)
        x, h = attn_out(x, attn, o_w, norm_w, eps)
        return mlp(x, h, gate_up_w, down_w)

    return one_attn_in, one_post_attn


def compiled(
    gemv: Collection[str] | None = None, one_row: str | None = None, many_rows: str | None = None
) -> LayerOps:
    """The torch.compile'd LayerOps (built once per process and choice of `gemv` and
    `one_row`; inductor compiles on first call, again per distinct dtype / None-ness of
    the optional weights, and once more with a symbolic T when T changes). `gemv`: the ops
    (of attn_in, attn_out, mlp, logits) whose one-row steps get a GEMV kernel instead of
    cuBLAS (None: GEMV_OPS; empty: cuBLAS for every matmul); `one_row` (None: ONE_ROW):
    which GEMV, "triton" (attn_in, and attn_out + mlp when both are listed) or "inductor"
    (GEMV_OPTIONS); `many_rows` (None: MANY_ROWS): "triton" or "cublas"."""
    global _COMPILED
    mode = ONE_ROW if one_row is None else one_row
    many = MANY_ROWS if many_rows is None else many_rows
    if many not in ("triton", "cublas"):
        raise ValueError(f"many_rows must be 'triton' or 'cublas', not {many!r}")
    key = (GEMV_OPS if gemv is None else frozenset(gemv), mode, many, COPY_FREE_RESIDUALS)
    if _COMPILED is None or _COMPILED[0] != key:
        names = key[0]

        def fuse(fn: Any, rows_fn: Any = None, general_fn: Any = None) -> Any:
            # general_fn: the general steps' function, compiled already (or fn compiled)
            general = general_fn or torch.compile(fn, fullgraph=True)
            # the same glue around rows_gemm's matmul (2..MAX_ROWS rows, 16-bit, CUDA)
            many_fn = None if rows_fn is None else torch.compile(rows_fn, fullgraph=True)
            one_row_fn = None
            if fn.__name__ in names:
                one_row_fn = torch.compile(fn, fullgraph=True, options=GEMV_OPTIONS)
            # static shapes: each tuned bucket gets the kernels tuned for its row count
            tuned = torch.compile(fn, fullgraph=True, dynamic=False, options=TUNED_OPTIONS)

            def call(x: torch.Tensor, *args: Any) -> Any:
                rows = x.shape[0]
                if rows == 1 and one_row_fn is not None:
                    return one_row_fn(x, *args)
                half = x.dtype in (torch.bfloat16, torch.float16)
                if rows in _tuned_rows and half:
                    return tuned(x, *args)
                if many_fn is not None and 1 < rows <= rows_gemm.MAX_ROWS and half and x.is_cuda:
                    return many_fn(x, *args)
                return general(x, *args)

            return call

        attn_in, attn_out, mlp = glue(F.linear)
        norm, logits = head(F.linear)
        r_in, r_out, r_mlp = glue(rows_gemm.linear) if many == "triton" else (None,) * 3
        r_logits = head(rows_gemm.linear)[1] if many == "triton" else None
        g_out = g_mlp = None
        if COPY_FREE_RESIDUALS:
            g_out = torch.compile(glue(F.linear, wide=True)[1], fullgraph=True)
            act = torch.compile(swiglu_of(F.linear), fullgraph=True)

            def g_mlp(x: torch.Tensor, h: torch.Tensor, gate_up_w: Any, down_w: Any) -> Any:
                return x.addmm_(act(h, gate_up_w), down_w.t())  # x: attn_out's output

        f_in, f_out = fuse(attn_in, r_in), fuse(attn_out, r_out, g_out)
        f_mlp = fuse(mlp, r_mlp, g_mlp)
        post_attn = None
        if mode == "triton":
            one_in, one_post = triton_one_row(f_in, f_out, f_mlp)
            if "attn_in" in names:
                general_in = f_in

                def f_in(x: torch.Tensor, *args: Any) -> Any:
                    return (one_in if x.shape[0] == 1 else general_in)(x, *args)

            if "attn_out" in names and "mlp" in names:

                def post_attn(
                    x: torch.Tensor,
                    attn: torch.Tensor,
                    o_w: Any,
                    norm_w: Any,
                    gate_up_w: Any,
                    down_w: Any,
                    eps: float,
                ) -> torch.Tensor:
                    if x.shape[0] == 1:
                        return one_post(x, attn, o_w, norm_w, gate_up_w, down_w, eps)
                    x, h = f_out(x, attn, o_w, norm_w, eps)
                    return f_mlp(x, h, gate_up_w, down_w)

        elif mode != "inductor":
            raise ValueError(f"one_row must be 'triton' or 'inductor', not {mode!r}")
        fused = LayerOps(
            f_in,
            f_out,
            f_mlp,
            fuse(norm),
            fuse(logits, r_logits),
            fused=True,
            post_attn=post_attn,
        )
        _COMPILED = (key, fused)
    return _COMPILED[1]


def set_layer_ops(model: torch.nn.Module, ops: LayerOps) -> None:
    """Make every decoder layer of `model` (a module with an `ops` LayerOps) run `ops`."""
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), LayerOps):
            module.ops = ops  # type: ignore[assignment]

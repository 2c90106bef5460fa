"""LayerOps: the element-wise parts of a Llama decoder layer, eager or fused by torch.compile.

A decoder layer is 3 matmuls-with-glue plus attention. At decode batch sizes the glue
(RMSNorm in float32, RoPE, residual adds, SwiGLU: ~20 small kernels per layer) costs more
than its bytes: each kernel is a few microseconds even replayed from a CUDA graph, ~2.8
ms per step of an 8B model. The three functions below are that glue around the matmuls;
torch.compile (inductor, Triton kernels on CUDA) fuses each into ~2 kernels and calls
cuBLAS for the matmuls:

    attn_in:   x -> RMSNorm -> qkv matmul -> (q|k RMSNorm) -> RoPE       -> q, k, v
    attn_out:  x, attn -> o matmul -> + x -> RMSNorm                     -> x, h
    mlp:       x, h -> gate|up matmul -> silu(gate) * up -> down matmul -> + x
    norm:      the final RMSNorm;  logits: lm_head matmul -> float32

EAGER runs them as written (the CPU path and the float32 reference: token-identical to
transformers); `compiled()` gives the fused versions (CUDA engines with decode graphs,
EngineConfig.compile_layers). One compiled function serves every layer (weights are
arguments, not attributes: no recompile per layer) and every batch size: the first call
compiles for its T, the second (another T) for a symbolic T (torch.compile's automatic
dynamic shapes; weight shapes stay static, so reductions keep their fixed-size kernels).

One-row steps (T = 1, decode at batch 1: torch.compile always specializes a size of 1)
compile with inductor's coordinate-descent tuning, under which inductor writes a [1, K] x
[K, N] matmul as a multiply-and-sum reduction it generates and tunes itself (a GEMV
kernel, with the RMSNorm before it and the SwiGLU or residual add around it fused in)
instead of calling cuBLAS, whose kernels for that shape read the weights below the
copy bandwidth (benchmarks/gpu_engine.py, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.cpu_gemm import linear
from engine.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D]; computed in float32 and cast back before the weight, as HF does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def glue(lin: Any) -> tuple[Any, Any, Any]:
    """attn_in, attn_out and mlp multiplying through `lin`: cpu_gemm.linear for EAGER (a
    weight's packed copy on CPU, else F.linear), F.linear for the compiled versions (CUDA
    weights are never packed, and the packed-copy lookup is not something to trace)."""

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        num_tokens = x.shape[0]
        d = qkv_w.shape[0] // (hq + 2 * hkv)
        h = rms_norm(x, norm_w, eps)
        qkv = lin(h, qkv_w, qkv_b)  # [T, (Hq+2Hkv) D]
        qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)  # [T, Hq+Hkv, D]
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)  # [T, Hkv, D]
        if qk_norm_w is not None:
            qk = rms_norm(qk, qk_norm_w, eps)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated in one pass
        return qk[:, :hq], qk[:, hq:], v

    def attn_out(
        x: torch.Tensor,  # [T, H] residual stream
        attn: torch.Tensor,  # [T, Hq, D]
        o_w: torch.Tensor,
        norm_w: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new residual x, normed h [T, H]
        x = x + lin(attn.reshape(x.shape[0], -1), o_w)
        return x, rms_norm(x, norm_w, eps)

    def mlp(
        x: torch.Tensor,  # [T, H] residual stream
        h: torch.Tensor,  # [T, H] normed
        gate_up_w: torch.Tensor,
        down_w: torch.Tensor,
    ) -> torch.Tensor:  # [T, H]
        gate, up = lin(h, gate_up_w).chunk(2, dim=-1)  # [T, I] each
        return x + lin(F.silu(gate) * up, down_w)

    return attn_in, attn_out, mlp


def head(lin: Any) -> tuple[Any, Any]:
    """The final RMSNorm and the lm_head matmul (float32 logits) through `lin`."""

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def logits(h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return lin(h, lm_head).float()

    return norm, logits


@dataclass(frozen=True)
class LayerOps:
    """The functions a LlamaDecoderLayer calls around attention (attn_in, attn_out, mlp)
    and the model calls after the last layer (norm, logits)."""

    attn_in: Any
    attn_out: Any
    mlp: Any
    norm: Any
    logits: Any
    fused: bool = False


EAGER = LayerOps(*glue(linear), *head(linear))

_COMPILED: tuple[frozenset[str], LayerOps] | None = None


GEMV_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}
"""Inductor options of the one-row (T = 1) compilations: under coordinate-descent tuning
inductor decomposes a matmul with one row into a reduction it generates (its `mm`
decomposition) and tunes that kernel's block sizes by measuring them."""


GEMV_OPS = frozenset({"attn_in", "attn_out", "mlp", "logits"})
"""The ops whose one-row steps go through inductor's GEMV by default (the others keep
cuBLAS for them)."""


def compiled(gemv: Collection[str] | None = None) -> LayerOps:
    """The torch.compile'd LayerOps (built once per process and choice of `gemv`; inductor
    compiles on first call, again per distinct dtype / None-ness of the optional weights,
    and once more with a symbolic T when T changes). `gemv`: the ops (of attn_in,
    attn_out, mlp, logits) whose one-row steps go through inductor's GEMV (GEMV_OPTIONS);
    None: GEMV_OPS; empty: cuBLAS for every matmul."""
    global _COMPILED
    key = GEMV_OPS if gemv is None else frozenset(gemv)
    if _COMPILED is None or _COMPILED[0] != key:

        def fuse(fn: Any) -> Any:
            general = torch.compile(fn, fullgraph=True)
            if fn.__name__ not in key:
                return general
            one_row = torch.compile(fn, fullgraph=True, options=GEMV_OPTIONS)

            def call(x: torch.Tensor, *args: Any) -> Any:
                return (one_row if x.shape[0] == 1 else general)(x, *args)

            return call

        attn_in, attn_out, mlp = glue(F.linear)
        norm, logits = head(F.linear)
        fused = LayerOps(
            fuse(attn_in), fuse(attn_out), fuse(mlp), fuse(norm), fuse(logits), fused=True
        )
        _COMPILED = (key, fused)
    return _COMPILED[1]


def set_layer_ops(model: torch.nn.Module, ops: LayerOps) -> None:
    """Make every decoder layer of `model` (a module with an `ops` LayerOps) run `ops`."""
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), LayerOps):
            module.ops = ops  # type: ignore[assignment]

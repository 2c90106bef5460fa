"""The flex backend's KV-cache write on CUDA: the new tokens' K and V rows stored at their
slots in ONE Triton launch (torch needs one index_copy_ each).

    cache [2, slots, Hkv, D] (a layer's paged cache viewed flat)
    cache[0, slot[t]] = k[t];  cache[1, slot[t]] = v[t]        (t < T, slot[t] >= 0)

k and v are views into the layer's projection output (row strides of their own; each
row's Hkv * D values contiguous). At decode batch sizes every launch inside the step's
CUDA graph costs a few microseconds, a cost paid per layer: this kernel halves the
write's share. tests/test_flex_kv_write.py checks it against index_copy_.

`rope_write` is the same write with the layer's RoPE folded in: for pure-decode steps of
more than one row the layer hands the backend q and k unrotated (LlamaDecoderLayer,
AttentionBackend.rotates_on_write), and one launch per layer rotates q into a new tensor
and k into the cache, and copies v; two kernels (the compiled glue's RoPE, this write)
become one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.triton_support import triton_runs_on


def usable(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """True when the kernel can write k and v [T, Hkv, D] into `cache` [2, nb, bs, Hkv, D]:
    CUDA (or the Triton interpreter), one dtype, rows contiguous inside, cache contiguous."""
    if not triton_runs_on(k.device):
        return False
    if not (k.dtype == v.dtype == cache.dtype and cache.is_contiguous()):
        return False
    d = k.shape[2]
    return all(t.stride(2) == 1 and t.stride(1) == d for t in (k, v))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv(k, v, cache, slots, k_stride, v_stride, plane, ROW: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, ROW)
            dst = cache + slot * ROW + offs
            tl.store(dst, tl.load(k + t * k_stride + offs))
            tl.store(dst + plane, tl.load(v + t * v_stride + offs))

    return write_kv


def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[0, slots[t]] = k[t] and cache[1, slots[t]] = v[t] for every t with a slot >= 0
    (usable(k, v, cache) must hold; Hkv * D a power of two)."""
    num_tokens, hkv, d = k.shape
    row = hkv * d
    assert row & (row - 1) == 0, "Hkv * D must be a power of two"
    if num_tokens == 0:
        return
    _kernel()[(num_tokens,)](
        k, v, cache, slots, k.stride(0), v.stride(0), cache[0].numel(), ROW=row, num_warps=4
    )


def rope_usable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
) -> bool:
    """True when rope_write can run: q [T, Hq, D], k, v [T, Hkv, D] the consecutive
    column ranges of one [T, (Hq + 2 Hkv) D] projection output (rows contiguous inside),
    cos / sin [T, 1, D] (full rotary) alike, D a power of two, usable(k, v, cache)."""
    if not usable(k, v, cache) or q.dtype != k.dtype or q.stride(2) != 1:
        return False
    hq, d = q.shape[1], q.shape[2]
    hkv, size = k.shape[1], q.element_size()
    return (
        d & (d - 1) == 0
        and d >= 2
        and cos.shape == sin.shape == (q.shape[0], 1, d)
        and cos.stride() == sin.stride()
        and cos.stride(-1) == 1
        and q.stride(1) == d
        and q.stride(0) == k.stride(0) == v.stride(0)
        and k.data_ptr() == q.data_ptr() + hq * d * size
        and v.data_ptr() == k.data_ptr() + hkv * d * size
    )


@functools.cache
def _rope_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_write_kv(
        qkv,
        cos,
        sin,
        q_out,
        cache,
        slots,
        row_stride,
        cs_stride,
        plane,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
    ):
        # program (t, h): head h of token t's q | k | v; q and k rotated (rotate_half form)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, D // 2)
        src = qkv + t * row_stride + h * D
        if h < HQ + HKV:
            x1 = tl.load(src + offs).to(tl.float32)
            x2 = tl.load(src + D // 2 + offs).to(tl.float32)
            c = cos + t * cs_stride
            s = sin + t * cs_stride
            y1 = x1 * tl.load(c + offs).to(tl.float32) - x2 * tl.load(s + offs).to(tl.float32)
            y2 = x2 * tl.load(c + D // 2 + offs).to(tl.float32) + x1 * tl.load(
                s + D // 2 + offs
            ).to(tl.float32)
            if h < HQ:
                dst = q_out + (t * HQ + h) * D
                tl.store(dst + offs, y1.to(q_out.dtype.element_ty))
                tl.store(dst + D // 2 + offs, y2.to(q_out.dtype.element_ty))
            else:
                slot = tl.load(slots + t).to(tl.int64)
                if slot >= 0:
                    dst = cache + (slot * HKV + h - HQ) * D
                    tl.store(dst + offs, y1.to(cache.dtype.element_ty))
                    tl.store(dst + D // 2 + offs, y2.to(cache.dtype.element_ty))
        else:
            slot = tl.load(slots + t).to(tl.int64)
            if slot >= 0:
                dst = cache + plane + (slot * HKV + h - HQ - HKV) * D
                tl.store(dst + offs, tl.load(src + offs))
                tl.store(dst + D // 2 + offs, tl.load(src + D // 2 + offs))

    return rope_write_kv


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:  # [T, Hq, D]: q rotated
    """RoPE and the K/V write in one launch: returns apply_rotary(q, cos, sin) and stores
    apply_rotary(k, cos, sin) at cache[0, slots[t]] and v at cache[1, slots[t]] for every
    t with a slot >= 0 (rope_usable(q, k, v, cos, sin, cache) must hold). The rotation is
    computed in float32 and rounded once, as the compiled layer ops' RoPE kernel does."""
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    _rope_kernel()[(num_tokens, hq + 2 * hkv)](
        q,
        cos,
        sin,
        out,
        cache,
        slots,
        q.stride(0),
        cos.stride(0),
        cache[0].numel(),
        HQ=hq,
        HKV=hkv,
        D=d,
        num_warps=1,
    )
    return out

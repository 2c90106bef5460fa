"""The flex backend's KV-cache write on CUDA: the new tokens' K and V rows stored at their
slots in ONE Triton launch (torch needs one index_copy_ each).

    cache [2, slots, Hkv, D] (a layer's paged cache viewed flat)
    cache[0, slot[t]] = k[t];  cache[1, slot[t]] = v[t]        (t < T, slot[t] >= 0)

k and v are views into the layer's projection output (row strides of their own; each
row's Hkv * D values contiguous). At decode batch sizes every launch inside the step's
CUDA graph costs a few microseconds, a cost paid per layer: this kernel halves the
write's share. tests/test_flex_kv_write.py checks it against index_copy_.
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

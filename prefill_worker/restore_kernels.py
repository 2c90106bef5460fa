"""Two Triton kernels of the worker's GPU pool restore (prefill_worker/pool_restore_gpu.py):
the payload sums of a group of staged payloads, and the unpack of a group into the
paged KV of every layer, each in ONE launch.

Why hand-written: kvpool's payload_sums_t in torch widens every int32 word to int64 in
a temporary (2x the payload), multiplies and sums it again (~4 passes over 2x the bytes),
and the torch unpack is one index_put per layer (32 Python launches per group for an 8B
model). On the restore's critical path these keep the host busy while the next group's
H2D copy should be queued. Both kernels compute exactly what the torch code computes
(integer sums with the same wraparound; plain element copies), and
tests/test_restore_kernels.py checks them against it (Triton's interpreter on CPU,
CUDA under -m gpu).

    sums:   payloads [G, W] int32 words -> [G, 2] int64 (s1, s2), as payload_sums_t
            (programs (g, w-block) write partial sums; one torch sum adds them)
    unpack: src [G, L, P, n, H, D] (payload g of the group, n = nblk * bs tokens)
            -> kv[l][p, ids[g * nblk + j]] = src[g, l, p, j*bs : (j+1)*bs]
            (one program per (l, p, g, j) copies one block: bs*H*D contiguous elements)

The layers are separate tensors; the unpack kernel addresses layer l as layer 0's pointer
plus (data_ptr(l) - data_ptr(0)) / element size elements (the caching allocator aligns
every tensor to 512 bytes, so the difference is a whole number of elements).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.triton_support import triton_runs_on

_MULT_K = 0x9E3779B1
"""kvpool/object_format.py's multiplier constant: m_i = 2 * ((i * K) mod 2^31) + 1."""

SUM_BLOCK = 8192
"""int32 words per program of the sums kernel (32 KiB)."""

COPY_BLOCK = 4096
"""Elements per step of an unpack program (a bf16 8B block of 16 x 8 x 128: 4 steps)."""


def available(device: torch.device) -> bool:
    """True when the kernels can run for tensors on `device` (CUDA with Triton, or any
    device under TRITON_INTERPRET=1 for the CPU tests)."""
    return triton_runs_on(device)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def sums_kernel(words, partial, num_words, row_stride, num_blocks, BLOCK: tl.constexpr):
        g = tl.program_id(0)
        blk = tl.program_id(1)
        i = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        keep = i < num_words
        w = tl.load(words + g.to(tl.int64) * row_stride + i, mask=keep, other=0).to(tl.int64)
        m = ((i * 0x9E3779B1) & 0x7FFFFFFF) * 2 + 1
        out = partial + (g.to(tl.int64) * num_blocks + blk) * 2
        tl.store(out, tl.sum(w, axis=0))
        tl.store(out + 1, tl.sum(w * m, axis=0))

    @triton.jit
    def unpack_kernel(
        src,
        dst0,
        layer_off,  # [L] int64: element offset of layer l's tensor from layer 0's
        ids,  # [G * nblk] int64 block ids, chunk-major
        nblk,
        parts,
        src_g_stride,
        src_l_stride,
        src_p_stride,
        dst_p_stride,
        ELEMS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # (l * parts + p) * nblk + j
        g = tl.program_id(1).to(tl.int64)
        j = pid % nblk
        lp = pid // nblk
        p = lp % parts
        layer = lp // parts
        block = tl.load(ids + g * nblk + j)
        s = src + g * src_g_stride + layer * src_l_stride + p * src_p_stride + j * ELEMS
        d = dst0 + tl.load(layer_off + layer) + p * dst_p_stride + block * ELEMS
        for start in range(0, ELEMS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            keep = offs < ELEMS
            tl.store(d + offs, tl.load(s + offs, mask=keep), mask=keep)

    return sums_kernel, unpack_kernel


def payload_sums(payloads_u8: torch.Tensor) -> torch.Tensor:
    """payload_sums_t of [G, nbytes] uint8 payloads (rows may be strided; nbytes % 4 == 0)
    -> [G, 2] int64 on the same device; asynchronous (no host sync)."""
    sums_kernel, _ = _kernels()
    num, nbytes = payloads_u8.shape
    assert nbytes % 4 == 0 and payloads_u8.stride(1) == 1 and payloads_u8.stride(0) % 4 == 0
    words = payloads_u8.view(torch.int32)  # [G, W] (row stride / 4)
    num_words = nbytes // 4
    blocks = -(-num_words // SUM_BLOCK)
    partial = torch.empty(num, blocks, 2, dtype=torch.int64, device=payloads_u8.device)
    sums_kernel[(num, blocks)](
        words, partial, num_words, words.stride(0), blocks, BLOCK=SUM_BLOCK, num_warps=8
    )
    return partial.sum(1)  # int64 addition wraps as the torch sums do


class LayerTable:
    """The element offsets of every layer's KV tensor from layer 0's, on the device (built
    once per list of caches)."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        first = layers[0]
        size = first.element_size()
        for kv in layers:
            assert kv.shape == first.shape and kv.dtype == first.dtype and kv.is_contiguous()
            assert (kv.data_ptr() - first.data_ptr()) % size == 0
        self.layers = layers
        self.offsets = torch.tensor(
            [(kv.data_ptr() - first.data_ptr()) // size for kv in layers],
            dtype=torch.int64,
            device=first.device,
        )


def unpack_chunks(src: torch.Tensor, table: LayerTable, block_ids: torch.Tensor) -> None:
    """prefill_worker/pool_pack.py's unpack_chunks in one launch: src [G, L, P, n, H, D]
    (each payload contiguous; any stride between payloads) into table.layers at
    block_ids ([G * n / bs] int64 on the device, chunk-major)."""
    _, unpack_kernel = _kernels()
    layers = table.layers
    num_chunks, num_layers, parts, n, h, d = src.shape
    _, num_blocks, bs, _, _ = layers[0].shape
    assert num_layers == len(layers) and src.dtype == layers[0].dtype
    assert src[0].is_contiguous() and n % bs == 0
    nblk = n // bs
    assert block_ids.numel() == num_chunks * nblk
    elems = bs * h * d
    unpack_kernel[(num_layers * parts * nblk, num_chunks)](
        src,
        layers[0],
        table.offsets,
        block_ids,
        nblk,
        parts,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        num_blocks * elems,
        ELEMS=elems,
        BLOCK=min(COPY_BLOCK, _pow2(elems)),
        num_warps=4,
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

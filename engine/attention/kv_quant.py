"""FP8 (e4m3) KV rows with their scales: quantize on cache write, dequantize on read.

A cache of KV cache dtype "fp8_e4m3" is uint8 (protocol/kv_layout.py); each head row of
K or V of one token is

    bytes 0 .. D-1: float8_e4m3fn values q_i | bytes D .. D+3: float32 scale s
    value_i = q_i * s,   s = max_i |x_i| * (1 / 448)   (1.0 for an all-zero row)

A scale per (token, head) follows the row's own range, so no calibration is needed and a
row's bytes depend on that row only: the prefix cache, the pool and the handoff move
rows without re-quantizing, and every rank computes the bytes the single process would.
The scale is a product with the constant 1/448, not a division by 448: CUDA divides a
tensor by a scalar as a product with its reciprocal, the CPU divides exactly, and the two
differed in the scale's last bit; a product rounds the same on both.
Backends tell the formats apart by the cache's dtype: uint8 means fp8 rows.
"""

from __future__ import annotations

import torch

from protocol.kv_layout import FP8_SCALE_BYTES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.uint8


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """Values per head row of a cache (its last dim less the scale for fp8 rows)."""
    width = kv_cache.shape[-1]
    return width - FP8_SCALE_BYTES if is_fp8_cache(kv_cache) else width


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] values -> [..., D + 4] uint8 fp8 rows (values, then the float32 scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] uint8 fp8 rows -> [..., D] values of `dtype` (q * scale in float32)."""
    d = rows.shape[-1] - FP8_SCALE_BYTES
    q = rows[..., :d].contiguous().view(FP8).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (q * scale).to(dtype)


def to_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows [T, H, D] in the cache's format (quantized for fp8 caches)."""
    return quantize(x) if is_fp8_cache(kv_cache) else x.to(kv_cache.dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache [..., row_width] as values of `dtype` [..., D]."""
    return dequantize(rows, dtype) if rows.dtype == torch.uint8 else rows.to(dtype)

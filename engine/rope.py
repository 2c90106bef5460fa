"""Rotary position embedding (RoPE), bit-compatible with Hugging Face Llama.

Neox / rotate-half convention: a head vector x of D dims is split in halves (x1, x2) and
rotated as x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), where
cos/sin of position p repeat the D/2 angles p * inv_freq[i] over both halves:

    dims:     0 .. D/2-1          D/2 .. D-1
    angle:    p*inv_freq[0..]     p*inv_freq[0..]   (same angles again)

GGUF files from llama.cpp store q/k rows in the interleaved (GPT-J) order; the weight
loader undoes that permutation, so this one convention serves every format.
"""

from __future__ import annotations

import math

import torch

from modelinfo.config import RopeScaling
from protocol.errors import ModelLoadError


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [D/2] float32, computed exactly as transformers'
    `ROPE_INIT_FUNCTIONS` do for rope_type default / linear / llama3."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling.kind == "default":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(
        f"RoPE scaling kind {scaling.kind!r} is not supported; supported: default, linear, llama3"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths are divided by `factor`,
    short ones kept, the band in between interpolated (transformers'
    `_compute_llama3_parameters`, same operation order so the floats agree)."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / s.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding:
    """Owns the inverse frequencies of one model and turns a step's positions into cos/sin.

    cos/sin are computed once per forward for that step's T positions and shared by every
    layer: for decode that is T angles, far cheaper than a table of max_position_embeddings
    rows (134 MB for a 128K-context, D=128 model), and it is the same float computation
    transformers does, so results match bit for bit.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling, device: torch.device
    ) -> None:
        self.head_dim = head_dim
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling).to(device)  # [D/2] f32

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, 1, D] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq  # [T, D/2] f32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, R] -> [T, H, D] (a new tensor): the leading R <= D dims
    rotated, the rest passed through (partial rotary, Glm4Moe; R = D elsewhere)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head = x[..., :rot]
    return torch.cat((head * cos + rotate_half(head) * sin, x[..., rot:]), dim=-1)

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

from modelinfo.config import RopeScaling, yarn_mscale
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
    if scaling.kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ModelLoadError(
        f"RoPE scaling kind {scaling.kind!r} is not supported; "
        "supported: default, linear, llama3, yarn"
    )


def attention_factor(scaling: RopeScaling) -> float:
    """The factor transformers multiplies cos and sin by: 1 except under yarn, where it is
    attention_factor, or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are given (DeepSeek), or mscale(factor)."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: dims rotating fewer than beta_slow times over the original context are
    interpolated (divided by factor), those rotating more than beta_fast times kept, a
    linear ramp between (transformers' `_compute_yarn_parameters`, same float order)."""

    def correction_dim(rotations: float) -> float:
        old = s.original_max_position_embeddings
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


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
        self.scaling = attention_factor(scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, 1, D] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq  # [T, D/2] f32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:  # yarn's attention factor
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R] whose dims are (x0, x1), (x2, x3), ... pairs, each rotated by one angle
    (DeepSeek's layout), cos/sin [T, 1, R] as cos_sin gives -> [T, H, R] with the rotated
    pairs de-interleaved: (x0', x2', ..., x1', x3', ...). The order is transformers'
    DeepSeek-V3 one; q and k get the same order, so q . k equals V2's interleaved output."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

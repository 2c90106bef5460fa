"""The batch-1 GEMV kernel (engine/models/gemv.py) against torch: each fused mode (RMSNorm
+ RoPE + bias over q|k|v, residual add, RMSNorm + SwiGLU over gate|up), and the one-row
layer ops built on it (engine/models/layer_ops.py) against the eager ops. CUDA under
-m gpu; on CPU through Triton's interpreter (TRITON_INTERPRET=1 with triton installed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import gemv
from engine.models.layer_ops import EAGER, triton_one_row
from engine.rope import RotaryEmbedding, apply_rotary
from modelinfo.config import RopeScaling

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensors(dtype: torch.dtype, *shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEVICE, dtype) for s in shapes]


def _need(x: torch.Tensor) -> None:
    if not gemv.usable(x):
        pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1 with triton installed")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 256), (48, 96)])  # 96: K no block divides (masked)
def test_plain_and_residual(dtype: torch.dtype, n: int, k: int) -> None:
    x, w, r = _tensors(dtype, (1, k), (n, k), (1, n))
    _need(x)
    _close(gemv.gemv(x, w), F.linear(x, w), dtype)
    _close(gemv.gemv(x, w, residual=r), r + F.linear(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_swiglu(dtype: torch.dtype) -> None:
    k, inter = 128, 96
    x, w, nw = _tensors(dtype, (1, k), (2 * inter, k), (k,), seed=1)
    _need(x)
    gate, up = F.linear(_rms(x, nw, 1e-5), w).chunk(2, dim=-1)
    got = gemv.gemv(x, w, norm=nw, eps=1e-5, swiglu=True)
    assert got.shape == (1, inter)
    _close(got, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_rope_qkv(dtype: torch.dtype, bias: bool) -> None:
    hq, hkv, d, k = 4, 2, 32, 128
    n = (hq + 2 * hkv) * d
    x, w, nw, b = _tensors(dtype, (1, k), (n, k), (k,), (n,), seed=2)
    _need(x)
    rope = RotaryEmbedding(d, 10000.0, RopeScaling(), DEVICE)
    cos, sin = rope.cos_sin(torch.tensor([37], device=DEVICE), dtype)  # [1, 1, D]
    qkv = F.linear(_rms(x, nw, 1e-6), w, b if bias else None)
    qk = apply_rotary(qkv[:, : (hq + hkv) * d].view(1, hq + hkv, d), cos, sin)
    want = torch.cat([qk.reshape(1, -1), qkv[:, (hq + hkv) * d :]], dim=-1)
    got = gemv.gemv(
        x,
        w,
        norm=nw,
        eps=1e-6,
        bias=b if bias else None,
        rope=(cos.reshape(-1), sin.reshape(-1), (hq + hkv) * d, d),
    )
    _close(got, want, dtype)


def test_shapes_no_block_divides() -> None:
    assert not gemv.fits(7)
    assert not gemv.fits(14, swiglu=True)  # 7 rows per half
    assert gemv.fits(4096) and gemv.fits(28672, swiglu=True) and gemv.fits(6144, head_dim=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_layer_ops_match_eager(dtype: torch.dtype) -> None:
    """A decoder layer's attn_in and attn_out + mlp through the kernel vs the eager ops."""
    hid, inter, hq, hkv, d = 128, 256, 4, 2, 32
    x, norm_in, qkv_w, o_w, norm_post, gu_w, down_w, attn = _tensors(
        dtype,
        (1, hid),
        (hid,),
        ((hq + 2 * hkv) * d, hid),
        (hid, hq * d),
        (hid,),
        (2 * inter, hid),
        (hid, inter),
        (1, hq, d),
        seed=3,
    )
    _need(x)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        # its casts to bf16 truncate where the GPU rounds to nearest: through a chain of
        # three matmuls that bias is 3x the rounding error of the eager ops
        pytest.skip("Triton's interpreter rounds bf16 toward zero; runs on CUDA")
    for t in (qkv_w, o_w, gu_w, down_w):
        t.mul_(0.1)
    rope = RotaryEmbedding(d, 10000.0, RopeScaling(), DEVICE)
    cos, sin = rope.cos_sin(torch.tensor([5], device=DEVICE), dtype)

    def no_fallback(*args: object) -> None:
        raise AssertionError("the kernel should apply here")

    one_in, one_post = triton_one_row(no_fallback, no_fallback, no_fallback)
    got = one_in(x, norm_in, qkv_w, None, None, cos, sin, 1e-5, hq, hkv)
    want = EAGER.attn_in(x, norm_in, qkv_w, None, None, cos, sin, 1e-5, hq, hkv)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        _close(g, w, dtype)
    got_out = one_post(x, attn, o_w, norm_post, gu_w, down_w, 1e-5)

    def eager_post(*ts: torch.Tensor) -> torch.Tensor:
        xx, aa, ow, nw, gw, dw = ts
        x2, h = EAGER.attn_out(xx, aa, ow, nw, 1e-5)
        return EAGER.mlp(x2, h, gw, dw)

    ts = (x, attn, o_w, norm_post, gu_w, down_w)
    want = eager_post(*ts)
    if dtype == torch.float32:
        _close(got_out, want, dtype)
    else:  # bf16 rounding of a chain of 3 matmuls: as close to float32 as the eager ops
        exact = eager_post(*(t.float() for t in ts))

        def rel(a: torch.Tensor) -> float:
            return ((a.float() - exact).norm() / exact.norm()).item()

        assert rel(got_out) <= 1.5 * rel(want) + 1e-3, (rel(got_out), rel(want))

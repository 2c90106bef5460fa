"""The flex backend's one-launch K/V cache write (engine/attention/flex_kv_write.py)
against two index_copy_ calls: strided k/v views as the projection leaves them, slots out
of order, -1 slots left alone. CUDA under -m gpu; on CPU through Triton's interpreter
(TRITON_INTERPRET=1 with triton installed)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import flex_kv_write

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_write_equals_index_copy(dtype: torch.dtype, num_tokens: int) -> None:
    hq, hkv, d, num_blocks, bs = 4, 2, 16, 40, 16
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(DEVICE, dtype)
    if not flex_kv_write.usable(k, v, cache):
        pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1 with triton installed")
    slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
    slots[::3] = -1  # another rank's tokens (decode context parallelism)
    slots = slots.to(DEVICE)
    ref = cache.clone()
    flat = ref.view(2, -1, hkv, d)
    keep = slots >= 0
    flat[0].index_copy_(0, slots[keep], k[keep])
    flat[1].index_copy_(0, slots[keep], v[keep])
    flex_kv_write.write(k, v, cache, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [2, 37])
def test_rope_write_equals_rotary_then_index_copy(dtype: torch.dtype, num_tokens: int) -> None:
    """rope_write: q rotated as apply_rotary does (float32 math, one rounding: the
    compiled glue's RoPE), k rotated into the cache, v copied, -1 slots left alone."""
    from engine.rope import RotaryEmbedding, apply_rotary
    from modelinfo.config import RopeScaling

    hq, hkv, d, num_blocks, bs = 4, 2, 32, 40, 16
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, : hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    positions = torch.randint(0, 5000, (num_tokens,), generator=g).to(DEVICE)
    rotary = RotaryEmbedding(d, 500000.0, RopeScaling(), DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(DEVICE, dtype)
    if not flex_kv_write.rope_usable(q, k, v, cos, sin, cache):
        pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1 with triton installed")
    assert not flex_kv_write.rope_usable(q, k.clone(), v, cos, sin, cache)  # not one tensor
    slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
    slots[::3] = -1
    slots = slots.to(DEVICE)
    # the reference in float32, rounded once
    q_ref = apply_rotary(q.float(), cos.float(), sin.float()).to(dtype)
    k_ref = apply_rotary(k.float(), cos.float(), sin.float()).to(dtype)
    ref = cache.clone()
    flat = ref.view(2, -1, hkv, d)
    keep = slots >= 0
    flat[0].index_copy_(0, slots[keep], k_ref[keep])
    flat[1].index_copy_(0, slots[keep], v[keep])
    got = flex_kv_write.rope_write(q, k, v, cos, sin, cache, slots)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}
    torch.testing.assert_close(got, q_ref, **tol)
    torch.testing.assert_close(cache, ref, **tol)
    # bf16: at most one rounding step apart (an FMA may round differently), v exact
    assert torch.equal(cache[1], ref[1])

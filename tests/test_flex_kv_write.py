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

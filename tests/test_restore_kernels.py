"""The Triton kernels of the worker's GPU restore (prefill_worker/restore_kernels.py)
against the torch code they replace: kvpool's payload sums (bit for bit, wraparound
included) and pool_pack.unpack_chunks (every page equal). CUDA under -m gpu; the same
test runs on CPU through Triton's interpreter (TRITON_INTERPRET=1 with triton installed).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpool.object_format import payload_sums_t
from prefill_worker import restore_kernels
from prefill_worker.pool_pack import unpack_chunks

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _need_kernels() -> None:
    if not restore_kernels.available(DEVICE):
        pytest.skip(
            "needs CUDA with Triton, or TRITON_INTERPRET=1 with triton installed"
            f" (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"
        )


@pytest.mark.parametrize("nbytes", [4, 4 * 8191, 4 * 8192, 4 * 8193 * 5 + 12])
def test_payload_sums_equal_kvpools_on_strided_rows(nbytes: int) -> None:
    _need_kernels()
    g = torch.Generator().manual_seed(nbytes)
    rows = torch.randint(0, 256, (3, nbytes + 64), dtype=torch.uint8, generator=g)
    rows[1].fill_(0xFF)  # every word -1: s2 wraps around int64
    rows = rows.to(DEVICE)[:, :nbytes]  # rows 64 bytes apart
    assert torch.equal(restore_kernels.payload_sums(rows).cpu(), payload_sums_t(rows).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpack_equals_torch_unpack_chunks(dtype: torch.dtype) -> None:
    _need_kernels()
    g = torch.Generator().manual_seed(1)
    num_layers, parts, bs, h, d, num_blocks, chunks, nblk = 5, 2, 16, 2, 8, 64, 3, 4
    layers = [
        torch.randn(parts, num_blocks, bs, h, d, generator=g).to(DEVICE, dtype)
        for _ in range(num_layers)
    ]
    ref = [t.clone() for t in layers]
    # payloads 1 element apart beyond their size (a staging buffer's stride)
    flat = torch.randn(chunks * (num_layers * parts * nblk * bs * h * d + 1), generator=g)
    tokens = nblk * bs
    payload = num_layers * parts * tokens * h * d
    src = flat.to(DEVICE, dtype).as_strided(
        (chunks, num_layers, parts, tokens, h, d),
        (payload + 1, parts * tokens * h * d, tokens * h * d, h * d, d, 1),
    )
    ids = torch.randperm(num_blocks, generator=g)[: chunks * nblk]
    restore_kernels.unpack_chunks(src, restore_kernels.LayerTable(layers), ids.to(DEVICE))
    unpack_chunks(src, ref, ids.tolist())
    for a, b in zip(layers, ref, strict=True):
        assert torch.equal(a, b)

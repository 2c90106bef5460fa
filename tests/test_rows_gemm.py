"""The 2-64-row GEMM (engine/models/rows_gemm.py) against torch: every candidate tiling,
split-K included (its locks reset for the next launch, also across CUDA graph replays),
the timed choice, the fallbacks to F.linear, and the compiled layer ops built on it
against the eager ops. Kernel tests run on CUDA under -m gpu, or on CPU through Triton's
interpreter (TRITON_INTERPRET=1 with triton installed; float16 only there: Triton 3.6's
interpreter gives wrong bf16 tl.dot products); the fallback tests run everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import layer_ops, rows_gemm
from engine.models.layer_ops import EAGER

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
"""bf16 as the engine runs it; float16 in the interpreter."""


def _tensors(dtype: torch.dtype, *shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEVICE, dtype) for s in shapes]


def _need(x: torch.Tensor, w: torch.Tensor) -> None:
    if not rows_gemm.usable(x, w):
        pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1 with triton installed")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


HID, INTER, HQ, HKV, D = 256, 512, 4, 2, 64
"""A small decoder layer's shapes for the compiled layer ops' tests."""


def _layer(t: int, seed: int) -> list[torch.Tensor]:
    """bf16 x, norm weight, q|k|v, o, gate|up, down weights and attention output of a
    `t`-row step, then RoPE's cos and sin."""
    return _tensors(
        torch.bfloat16,
        (t, HID),
        (HID,),
        ((HQ + 2 * HKV) * D, HID),
        (HID, HQ * D),
        (2 * INTER, HID),
        (HID, INTER),
        (t, HQ, D),
        seed=seed,
    ) + _tensors(torch.bfloat16, (t, 1, D), (t, 1, D), seed=seed + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 20, 64])  # row classes 16, 32, 64; rows masked
def test_every_tiling_matches_torch(rows: int) -> None:
    n, k, dtype = 256, 512, DTYPE
    x, w = _tensors(dtype, (rows, k), (n, k), seed=rows)
    _need(x, w)
    want = F.linear(x.float(), w.float())
    ran = 0
    for cfg in rows_gemm.CANDIDATES:
        if not rows_gemm.fits(cfg, n, k):
            continue
        for _ in range(2):  # the second launch reuses the split tiles' locks
            got = rows_gemm.launch(x, w, cfg)
            assert got.shape == (rows, n) and got.dtype == dtype
            assert _rel(got, want) < 1e-2, (cfg, _rel(got, want))
        ran += 1
    assert ran == len(rows_gemm.CANDIDATES)
    assert int(rows_gemm._locks(x.device).abs().sum()) == 0  # every lock reset


@pytest.mark.gpu
def test_split_k_in_a_cuda_graph_replays() -> None:
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA")
    x, w = _tensors(torch.bfloat16, (64, 4096), (512, 4096), seed=3)
    cfg = rows_gemm.Config(128, 64, 4, 4, 4)
    static = x.clone()
    rows_gemm.launch(static, w, cfg)  # compile and allocate the locks outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows_gemm.launch(static, w, cfg)
    for seed in range(3):
        static.copy_(_tensors(torch.bfloat16, (64, 4096), seed=10 + seed)[0])
        graph.replay()
        assert _rel(out, F.linear(static.float(), w.float())) < 1e-2


@pytest.mark.gpu
def test_timed_choice_and_linear() -> None:
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA")
    x, w, b = _tensors(torch.bfloat16, (32, 1024), (2048, 1024), (2048,), seed=4)
    got = rows_gemm.linear(x, w, b)
    assert _rel(got, F.linear(x.float(), w.float(), b.float())) < 1e-2
    assert "rows<=32 N=2048 K=1024" in rows_gemm.chosen()


@pytest.mark.gpu
def test_compiled_layer_ops_many_rows_match_eager() -> None:
    """The glue around rows_gemm (a decode step of 8 rows) against the eager ops."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA")
    hq, hkv = HQ, HKV
    x, nw, qkv_w, o_w, gu_w, down_w, attn, cos, sin = _layer(8, seed=5)
    ops = layer_ops.compiled(many_rows="triton")
    for got, want in zip(
        ops.attn_in(x, nw, qkv_w, None, None, cos, sin, 1e-5, hq, hkv),
        EAGER.attn_in(x, nw, qkv_w, None, None, cos, sin, 1e-5, hq, hkv),
        strict=True,
    ):
        assert _rel(got, want) < 2e-2
    got_x, got_h = ops.attn_out(x, attn, o_w, nw, 1e-5)
    want_x, want_h = EAGER.attn_out(x, attn, o_w, nw, 1e-5)
    assert _rel(got_x, want_x) < 2e-2 and _rel(got_h, want_h) < 2e-2
    assert _rel(ops.mlp(x, want_h, gu_w, down_w), EAGER.mlp(x, want_h, gu_w, down_w)) < 2e-2
    assert any(key.startswith("rows<=16 ") for key in rows_gemm.chosen())


@pytest.mark.gpu
@pytest.mark.parametrize("copy_free", [True, False])
def test_compiled_layer_ops_general_path_match_eager(
    copy_free: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The general compilation (steps over rows_gemm.MAX_ROWS rows: cuBLAS), with and
    without COPY_FREE_RESIDUALS, against the eager ops at 128 and then 96 rows (the
    symbolic row count torch.compile moves to on a second size); copy-free, mlp adds
    onto its x in place and returns it."""
    if DEVICE.type != "cuda":
        pytest.skip("needs CUDA")
    monkeypatch.setattr(layer_ops, "COPY_FREE_RESIDUALS", copy_free)
    ops = layer_ops.compiled(many_rows="triton")
    hq, hkv = HQ, HKV
    for t in (128, 96):
        x, nw, qkv_w, o_w, gu_w, down_w, attn, cos, sin = _layer(t, seed=t)
        got = ops.attn_in(x, nw, qkv_w, None, None, cos, sin, 1e-5, hq, hkv)
        want = EAGER.attn_in(x, nw, qkv_w, None, None, cos, sin, 1e-5, hq, hkv)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and _rel(g, w) < 2e-2
        got_x, got_h = ops.attn_out(x, attn, o_w, nw, 1e-5)
        want_x, want_h = EAGER.attn_out(x, attn, o_w, nw, 1e-5)
        assert _rel(got_x, want_x) < 1e-2 and _rel(got_h, want_h) < 2e-2
        want = EAGER.mlp(want_x, want_h, gu_w, down_w)
        out = ops.mlp(got_x, want_h, gu_w, down_w)
        assert _rel(out, want) < 2e-2
        assert (out.data_ptr() == got_x.data_ptr()) == copy_free


@pytest.mark.parametrize(
    "shape_x,shape_w,dtype",
    [
        ((4, 128), (64, 128), torch.float32),  # not 16-bit
        ((1, 128), (64, 128), torch.float16),  # one row: gemv.py's case
        ((65, 128), (64, 128), torch.float16),  # past MAX_ROWS: cuBLAS
        ((4, 128), (96, 128), torch.float16),  # N no tile divides
    ],
)
def test_falls_back_to_linear(
    shape_x: tuple[int, int], shape_w: tuple[int, int], dtype: torch.dtype
) -> None:
    x, w = (t.to(dtype) for t in _tensors(torch.float32, shape_x, shape_w, seed=7))
    assert not rows_gemm.usable(x, w)
    assert torch.equal(rows_gemm.matmul(x, w), F.linear(x, w))


def test_fits_and_row_classes() -> None:
    cfg = rows_gemm.Config(128, 64, 4, 4, 4)
    assert rows_gemm.fits(cfg, 4096, 4096) and rows_gemm.fits(cfg, 4096, 14336)
    assert not rows_gemm.fits(cfg, 4096 + 64, 4096)  # N: whole tiles
    assert not rows_gemm.fits(cfg, 4096, 64 * 6)  # 6 K tiles in 4 splits
    assert [rows_gemm.row_class(r) for r in (2, 16, 17, 32, 33, 100, 128)] == [
        16,
        16,
        32,
        32,
        64,
        128,
        128,
    ]

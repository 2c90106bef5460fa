"""Packed oneDNN weights on CPU (engine/models/cpu_gemm.py) change speed, not numbers:
`linear` through a packed bf16 weight is bit-identical to F.linear at every row count
where oneDNN runs the same kernel for both (on CPUs without bf16 instructions, a few
elements at a few row counts round one bf16 step apart, and no more), and a whole bf16
model with packed weights (qkv bias, tied lm_head) gives the same
logits, bit for bit, as the same model without them. float32 is never packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_vs_transformers import PagedRunner, engine_config, make_tiny

from engine.attention.base import get_backend
from engine.models.cpu_gemm import linear, pack_linear_weights, packing_available
from engine.models.llama import LINEAR_WEIGHTS
from engine.models.registry import build_model
from engine.weights.cache import load_weights

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.bfloat16), reason="torch without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).bfloat16()
    b = torch.randn(960, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 576, generator=g).bfloat16()

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_weight = torch.nn.Parameter(w.clone(), requires_grad=False)

    m = Holder()
    assert pack_linear_weights(m, ("qkv_weight",), (Holder,)) == 1
    assert hasattr(m.qkv_weight, "_packed")
    got, want = linear(x, m.qkv_weight, b), F.linear(x, w, b)
    if torch.equal(got, want):
        return
    # On a CPU without bf16 instructions (AVX-512 only) oneDNN blocks the packed layout
    # (tuned for one row) and F.linear's (reordered for this call's rows) differently at a
    # few row counts: the sums round apart by one bf16 step in a few elements, never more.
    diff = (got.float() - want.float()).abs()
    _, exponent = torch.frexp(want.float())
    ulp = torch.ldexp(torch.ones_like(diff), exponent - 8)  # bf16 keeps 8 significant bits
    assert bool((diff <= ulp).all()), (diff / ulp).max()
    assert (diff > 0).float().mean().item() <= 0.01, (diff > 0).sum()


def _unpack(model: torch.nn.Module) -> int:
    n = 0
    for module in model.modules():
        for name in LINEAR_WEIGHTS:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor) and hasattr(w, "_packed"):
                del w._packed
                n += 1
    return n


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qkv bias + tied lm_head; untied
def test_packed_model_gives_identical_logits(arch: str, tmp_path: Path) -> None:
    make_tiny(tmp_path, arch)
    config = engine_config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    model = build_model(
        config, dtype=torch.bfloat16, device="cpu", backend=get_backend("torch"), weights=weights
    )
    prompts = {0: list(range(10, 50)), 1: list(range(200, 207))}
    packed_logits = PagedRunner(model).step(prompts)
    packed_next = PagedRunner(model).step({0: [3], 1: [4]})  # a decode-sized batch too
    assert _unpack(model) == 4 * config.num_layers + 1  # every projection and lm_head
    plain = PagedRunner(model)
    assert torch.equal(plain.step(prompts), packed_logits)
    assert torch.equal(PagedRunner(model).step({0: [3], 1: [4]}), packed_next)


def test_float32_is_never_packed(tmp_path: Path) -> None:
    make_tiny(tmp_path, "llama")
    config = engine_config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    model = build_model(
        config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
    )
    assert _unpack(model) == 0

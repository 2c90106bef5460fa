"""Linear layers on CPU with oneDNN-packed weights (bf16 / fp16).

`F.linear` on a bfloat16 CPU tensor hands oneDNN the plain [out, in] weight, and oneDNN
reorders it into its blocked GEMM layout on every call: at decode batch sizes (a few rows)
that reorder costs as much as the product itself. `pack_linear_weights` reorders every
projection weight of a model once at load and hangs the packed copy on the weight
(`_packed`); `linear` uses it when present. The result is F.linear's (the same oneDNN
kernel, minus the per-call reorder), bit for bit where oneDNN blocks both layouts alike:
on a CPU without bf16 instructions a few elements at 2-3 rows round one bf16 step apart
(tests/test_cpu_gemm.py), about 2x faster
per call at 1-2 rows (docs/benchmarks.md). float32 keeps F.linear (MKL): the exactness
reference is not touched."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed weights apply: CPU, a 16-bit float dtype, torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the weight's packed copy when it has one."""
    packed = getattr(weight, "_packed", None)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(
    model: nn.Module,
    names: tuple[str, ...],
    modules: tuple[type[nn.Module], ...],
    rows_hint: int = 1,
) -> int:
    """Attach a packed copy to every 2-D weight held under one of `names` by a module of
    `model` of one of the `modules` types (the ones that multiply through `linear`;
    attributes, so a tied lm_head is found under its own name); returns how many were
    packed. `rows_hint` is the row count oneDNN tunes the layout for (any count stays
    correct)."""
    n = 0
    for module in model.modules():
        if not isinstance(module, modules):
            continue
        for name in names:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor) and w.dim() == 2 and not hasattr(w, "_packed"):
                w._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)  # type: ignore[attr-defined]
                n += 1
    return n

"""Whether the Triton kernels of the engine and the workers (engine/models/gemv.py,
rows_gemm.py, engine/attention/flex_kv_write.py, prefill_worker/restore_kernels.py) can
run for tensors on a device."""

from __future__ import annotations

import functools
import os

import torch


def triton_runs_on(device: torch.device) -> bool:
    """CUDA with Triton importable, or any device under TRITON_INTERPRET=1 (Triton's
    interpreter: how the kernels' CPU tests run them)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

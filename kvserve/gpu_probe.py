"""The memory of this machine's GPUs, for the budget check of GPUs shared by several
instances (protocol/device_budget.py), read with nvidia-smi (no torch, no CUDA context).

Device names are the cluster's: "cuda:N" for GPU index N as nvidia-smi numbers them.
"""

from __future__ import annotations

import shutil
import subprocess

MiB = 1024**2


def probe_gpu_memory(timeout_s: float = 10.0) -> dict[str, int]:
    """{"cuda:0": total bytes, ...}; empty when there is no NVIDIA GPU or nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_nvidia_smi(out)


def parse_nvidia_smi(out: str) -> dict[str, int]:
    """Lines "0, 143771" (index, MiB) -> {"cuda:0": bytes}; other lines are skipped."""
    totals = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            totals[f"cuda:{parts[0]}"] = int(parts[1]) * MiB
    return totals

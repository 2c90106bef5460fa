"""The matmuls of a Llama-3-8B decode step alone, one GPU: cuBLAS (F.linear) against the
kernels torch.compile generates, at the step's row counts (1, 32, 128).

    python benchmarks/gpu_gemv.py [--rows 1,32,128] [--autotune]

Per weight shape of the model (q|k|v 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096,
down 4096 x 14336, lm_head 128256 x 4096; bf16) the matmul runs over 32 different copies
of the weight in turn (as the 32 layers do, so the 60 MB L2 holds none of them), all 32
calls in one CUDA graph (no launch overhead, as in the engine's decode graphs), timed
with CUDA events; GB/s counts the weight bytes read. Variants:

- cublas: F.linear, what an uncompiled step calls;
- inductor-gemv: torch.compile with coordinate-descent tuning, under which inductor
  writes a one-row matmul as a reduction kernel of its own (rows = 1 only);
- triton: engine/models/gemv.py's kernel, plain (rows = 1 only);
- triton+glue: the same with the glue the engine fuses into that weight's GEMV: q|k|v
  the RMSNorm and RoPE, o and down the residual add, gate|up the RMSNorm and SwiGLU, lm_head
  none (rows = 1 only);
- rows-gemm <tiling> (rows > 1): engine/models/rows_gemm.py's kernel under each of its
  candidate tilings (BN x BK, K splits, warps, stages); rows-gemm (chosen): its
  `matmul`, the choice it times itself (cuBLAS or a tiling) as the engine does;
- autotune (--autotune): torch.compile mode max-autotune-no-cudagraphs, inductor's
  Triton matmul templates benchmarked against cuBLAS (rows > 1).

The ceiling is a device copy (read + write) measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_engine_setup import ceilings
from engine.models import gemv as row_gemv
from engine.models import rows_gemm
from engine.models.layer_ops import GEMV_OPTIONS

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _glue(name: str, x: torch.Tensor, n: int) -> Any:
    """The engine's fused GEMV for weight `name` (None for lm_head: no glue there)."""
    k = x.shape[-1]
    dev, dt = x.device, x.dtype
    norm = torch.rand(k, device=dev, dtype=dt) + 0.5
    if name == "qkv":
        cos, sin = torch.rand(128, device=dev, dtype=dt), torch.rand(128, device=dev, dtype=dt)
        rope = (cos, sin, 40 * 128, 128)
        return lambda w: row_gemv.gemv(x, w, norm=norm, eps=1e-5, rope=rope)
    if name == "gate_up":
        return lambda w: row_gemv.gemv(x, w, norm=norm, eps=1e-5, swiglu=True)
    if name in ("o", "down"):
        res = torch.randn(1, n, device=dev, dtype=dt)
        return lambda w: row_gemv.gemv(x, w, residual=res)
    return None


def events_ms(fn: Any, weights: list[torch.Tensor], reps: int = 5) -> float:
    """Median over `reps` replays of the mean ms of one call: one CUDA graph calls fn once
    per weight (launch overhead out, as in the engine's decode graphs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / len(weights))
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--autotune", action="store_true")
    args = ap.parse_args()
    bw, _ = ceilings()
    print(f"ceiling: copy {bw:.0f} GB/s (read + write)", flush=True)
    print("| weight | rows | variant | us | GB/s (weights) | of copy |")
    print("|---|---:|---|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        copies = 2 if name == "lm_head" else 32
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        wbytes = n * k * 2
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            variants: dict[str, Any] = {"cublas": lambda w, x=x: F.linear(x, w)}
            torch._dynamo.reset()  # each variant compiles for its own static shapes
            if rows == 1:
                gemv = torch.compile(_linear, fullgraph=True, options=GEMV_OPTIONS)
                variants["inductor-gemv"] = lambda w, x=x, f=gemv: f(x, w)
                variants["triton"] = lambda w, x=x: row_gemv.gemv(x, w)
                glue = _glue(name, x, n)
                if glue is not None:
                    variants["triton+glue"] = glue
            else:
                for cfg in rows_gemm.CANDIDATES:
                    if rows_gemm.fits(cfg, n, k):
                        label = (
                            f"rows-gemm {cfg.block_n}x{cfg.block_k} split {cfg.split} "
                            f"w{cfg.warps} s{cfg.stages}"
                        )
                        variants[label] = lambda w, x=x, c=cfg: rows_gemm.launch(x, w, c)
                variants["rows-gemm (chosen)"] = lambda w, x=x: rows_gemm.matmul(x, w)
            if rows > 1 and args.autotune:
                tuned = torch.compile(_linear, fullgraph=True, mode="max-autotune-no-cudagraphs")
                variants["autotune"] = lambda w, x=x, f=tuned: f(x, w)
            ref = F.linear(x, weights[0]).float()
            for label, fn in variants.items():
                try:
                    out = fn(weights[0]).float()
                    # the glue changes the result: only the plain variants compare
                    err = float("nan")
                    if label != "triton+glue":
                        err = ((out - ref).norm() / ref.norm()).item()
                    ms = events_ms(fn, weights)
                except Exception as e:  # a variant that does not compile: say so, go on
                    print(f"| {name} | {rows} | {label} | failed: {e!r:.100} | | |", flush=True)
                    continue
                gbps = wbytes / ms / 1e6
                print(
                    f"| {name} | {rows} | {label} | {ms * 1e3:.1f} | {gbps:,.0f} | "
                    f"{gbps / bw:.0%} (rel err {err:.1e}) |",
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Prefill and decode sharing one GPU: two processes (two CUDA contexts, as single-gpu.yaml's
prefill and decode instances run today) against one process that runs both on two streams
of one context, and each alone.

    python benchmarks/gpu_colocation.py [--seconds 12] [--decode 8x8192] [--prefill 8192x8192]

The engine's forward on the random bf16 Llama-3-8B shape of benchmarks/gpu_engine.py (flex
backend, compiled layers; decode through its CUDA graphs, prefill eager), each role with its
own copy of the weights and its own paged KV of random values:
- decode: steps of B rows at context C, the same step again and again (execute, argmax,
  the tokens copied to the host, wait for them): ms per step;
- prefill: steps of N new tokens behind P cached ones (execute, wait): tokens per second.

Cases, each for `--seconds` of both loops running at once:
1. alone: each loop by itself (the ceiling of each);
2. one process, two threads, decode on a high-priority stream and prefill on a
   low-priority one (kernels of both may run at once; a waiting decode kernel is
   scheduled before prefill's next thread blocks);
3. the same with equal priorities;
4. two processes (spawned; each builds its own model and runner), started together.

"share" is each loop's speed as a fraction of its speed alone, and their sum says how
much of the GPU the pair gets (1.0: as if the GPU were handed from one to the other for
free; below: lost to switching; above: the two overlap). The serving run's timeline
(docs/benchmarks.md, "Ninth run") suggested ~0.6 for two processes.

`--device cpu` runs the same flow on a tiny float32 model on the CPU (no graphs, no
streams): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import gpu_engine_setup as setup
from benchmarks.gpu_engine_setup import (
    LLAMA3_8B,
    TINY,
    FakeKV,
    FakeRequest,
    decode_rows,
    hf_model,
    make_runner,
    ours,
    step_of,
)
from engine.model_runner import ModelRunner


@dataclass(frozen=True)
class Shape:
    device: str
    cfg: dict[str, Any]
    dtype: torch.dtype
    decode: tuple[int, int]  # rows, context
    prefill: tuple[int, int]  # new tokens, cached prefix


@dataclass
class Loop:
    """One role's step, ready to run again and again."""

    role: str
    step: Any
    work: float  # tokens a step produces (decode: rows; prefill: new tokens)


def build(shape: Shape, role: str) -> Loop:
    """A model, a runner and the role's repeated step (see the module docstring)."""
    hf = hf_model(shape.cfg, shape.dtype, device=shape.device)
    backend = "flex" if shape.device == "cuda" else "torch"
    model = ours(hf, shape.cfg, shape.dtype, backend, device=shape.device)
    del hf
    cuda = shape.device == "cuda"
    gen = torch.Generator().manual_seed(7)
    if role == "decode":
        rows, ctx = shape.decode
        per_seq = -(-(ctx + 1) // setup.BLOCK)
        runner = make_runner(
            model, rows * per_seq, shape.dtype, cuda, rows, sizes=[rows], device=shape.device
        )
        kv, reqs = decode_rows(rows, ctx, torch.randperm(rows * per_seq, generator=gen), per_seq)
        sched = step_of(reqs, [1] * rows)
        host = torch.empty(rows, dtype=torch.int64, pin_memory=cuda)

        def decode_step() -> None:
            logits = runner.execute(sched, cast(Any, kv))
            assert logits is not None
            host.copy_(logits.argmax(-1), non_blocking=cuda)
            wait(cuda)

        step, work = decode_step, float(rows)
    else:
        new, ctx = shape.prefill
        blocks = -(-(ctx + new) // setup.BLOCK)
        kv = FakeKV()
        runner = make_runner(model, blocks, shape.dtype, False, 1, device=shape.device)
        kv.tables["p"] = torch.randperm(blocks, generator=gen).tolist()
        sched = step_of([FakeRequest("p", [11] * (ctx + new), ctx)], [new])

        def prefill_step() -> None:
            logits = runner.execute(sched, cast(Any, kv))
            assert logits is not None
            wait(cuda)

        step, work = prefill_step, float(new)
    randomize(runner)
    for _ in range(3):  # compile, autotune, first-use costs
        step()
    return Loop(role, step, work)


def wait(cuda: bool) -> None:
    """Wait for this thread's stream (an event's wait lets other threads run)."""
    if cuda:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


def randomize(runner: ModelRunner) -> None:
    for c in runner.kv_caches:  # timing on zeros flatters kernels
        if c.is_floating_point():
            c.normal_()


def run_for(loop: Loop, seconds: float, stream: Any) -> tuple[int, float]:
    """(steps, wall seconds) of `loop` run back to back for `seconds` on `stream`."""
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            loop.step()
            steps += 1
        return steps, time.perf_counter() - t0


def rate(loop: Loop, steps: int, wall: float) -> float:
    return steps * loop.work / wall


def threads_case(
    loops: dict[str, Loop], seconds: float, priorities: dict[str, int] | None
) -> dict[str, float]:
    """Both loops at once in this process, each on its own stream (priorities: lower is
    more urgent; None: no streams, the CPU check); work per second."""
    streams = {
        r: (torch.cuda.Stream(priority=priorities[r]) if priorities is not None else None)
        for r in loops
    }
    out: dict[str, float] = {}
    start = threading.Barrier(len(loops))

    def body(role: str) -> None:
        start.wait()
        steps, wall = run_for(loops[role], seconds, streams[role])
        out[role] = rate(loops[role], steps, wall)

    workers = [threading.Thread(target=body, args=(r,)) for r in loops]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out


def child(shape: Shape, role: str, seconds: float, start: Any, results: Any) -> None:
    """One role in its own process (its own CUDA context), started with the other."""
    torch._dynamo.config.recompile_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = False
    loop = build(shape, role)
    start.wait()
    steps, wall = run_for(loop, seconds, None)
    results.put((role, rate(loop, steps, wall)))


def processes_case(shape: Shape, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=child, args=(shape, role, seconds, start, results))
        for role in ("decode", "prefill")
    ]
    for p in procs:
        p.start()
    out: dict[str, float] = {}
    for _ in procs:
        role, r = results.get(timeout=600)
        out[role] = r
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a {p.name} exited with {p.exitcode}")
    return out


def fmt_row(name: str, got: dict[str, float], alone: dict[str, float], rows: int) -> str:
    d, p = got["decode"], got["prefill"]
    ds, ps = d / alone["decode"], p / alone["prefill"]
    return (
        f"| {name} | {1e3 * rows / d:.2f} | {p / 1e3:.1f}K | {ds:.2f} | {ps:.2f} "
        f"| **{ds + ps:.2f}** |"
    )


def pair(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--decode", type=pair, default=(8, 8192), help="ROWSxCONTEXT")
    ap.add_argument("--prefill", type=pair, default=(8192, 8192), help="NEWxPREFIX")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = args.device == "cuda"
    shape = Shape(
        args.device,
        LLAMA3_8B if cuda else TINY,
        torch.bfloat16 if cuda else torch.float32,
        args.decode,
        args.prefill,
    )
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    loops = {role: build(shape, role) for role in ("decode", "prefill")}
    print(f"two models and runners built in {time.perf_counter() - t0:.0f} s", flush=True)

    alone = {r: rate(loops[r], *run_for(loops[r], args.seconds, None)) for r in loops}
    print(f"alone: {alone}", flush=True)
    # -5 maps to the device's most urgent priority (torch clamps to the range).
    urgent = {"decode": -5, "prefill": 0} if cuda else None
    equal = {"decode": 0, "prefill": 0} if cuda else None
    rows = [("alone (each by itself)", alone)]
    got = threads_case(loops, args.seconds, urgent)
    print(f"one process, priorities: {got}", flush=True)
    rows.append(("one process, two streams, decode high priority", got))
    got = threads_case(loops, args.seconds, equal)
    print(f"one process, equal: {got}", flush=True)
    rows.append(("one process, two streams, equal priority", got))
    del loops
    if cuda:
        torch.cuda.empty_cache()
    got = processes_case(shape, args.seconds)
    print(f"two processes: {got}", flush=True)
    rows.append(("two processes (two CUDA contexts)", got))

    b, c = shape.decode
    n, p = shape.prefill
    print(
        f"\ndecode {b} rows x {c} context, prefill {n} new tokens behind {p}, "
        f"{args.seconds:.0f} s per case"
    )
    print("| case | decode ms/step | prefill tok/s | decode share | prefill share | sum |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| alone (each by itself) | {1e3 * b / alone['decode']:.2f} | "
        f"{alone['prefill'] / 1e3:.1f}K | 1 | 1 | – |"
    )
    for name, g in rows[1:]:
        print(fmt_row(name, g, alone, b))


if __name__ == "__main__":
    main()

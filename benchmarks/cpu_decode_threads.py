"""A decode step on 1 vs 2 torch threads, wall and CPU clock, in one engine.

    python -m benchmarks.cpu_decode_threads [--context 2048] [--batch 2] [--steps 15]
        [--reps 3] [--fifo] [--competitor 0.1]

SmolLM2 bf16 with the `cpu` attention backend (the unified default's engine): `--batch`
sequences of `--context` tokens are prefilled, then runs of `--steps` decode steps
alternate between 1 and 2 torch threads (1, 2, 1, 2, ...) so a neighbour's load hits
both alike; the median wall and CPU ms per step of each run are printed.

Run it pinned to two cores (`taskset -c 0,1`) with OMP_WAIT_POLICY=PASSIVE, as the
unified instance runs. On a shared machine the wall clock is what the other tenants
leave: `--fifo` runs the measured steps (not the set-up) under SCHED_FIFO (root only),
which gives them the cores as on a quiet machine; `--competitor DUTY` starts a process
pinned to the last core, busy DUTY of every 10 ms at a higher real-time priority, so it
preempts the engine like the router and the clients do (`--fifo` only). Each run is a
few seconds: do not leave SCHED_FIFO work running on a shared box for long.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

MODEL = "builtin:smollm2-135m-instruct"

_BUSY = """
import os, sys, time
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(60))
duty, period = float(sys.argv[1]), 0.010
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep((1 - duty) * period)
"""


def _fifo(on: bool) -> None:
    """Every thread of this process (OpenMP's included) to SCHED_FIFO 50, or back."""
    policy = os.SCHED_FIFO if on else os.SCHED_OTHER
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), policy, os.sched_param(50 if on else 0))


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_decode_threads", description=__doc__
    )
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fifo", action="store_true")
    ap.add_argument("--competitor", type=float, default=0.0)
    args = ap.parse_args()
    need = args.context + args.reps * 2 * (args.steps + 1) + 8
    eng = LLMEngine.from_spec(
        MODEL,
        EngineConfig(
            dtype="bfloat16",
            attention_backend="cpu",
            num_blocks=args.batch * (-(-need // 16)) + 64,
            max_num_batched_tokens=2048,
        ),
    )
    rng = random.Random(0)
    vocab = eng.info.config.vocab_size
    params = SamplingParams(max_tokens=need - args.context, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request([rng.randrange(100, vocab) for _ in range(args.context)], params, f"r{i}")
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    torch.set_num_threads(2)
    eng.step()  # every request decoding, both OpenMP threads started
    busy = None
    if args.competitor > 0 and args.fifo:
        last = max(os.sched_getaffinity(0))
        busy = subprocess.Popen(
            ["taskset", "-c", str(last), sys.executable, "-c", _BUSY, str(args.competitor)]
        )
        time.sleep(0.3)
    runs: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    try:
        if args.fifo:
            _fifo(True)
        for _ in range(args.reps):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                eng.step()
                wall, cpu = [], []
                for _ in range(args.steps):
                    w0, c0 = time.perf_counter(), time.process_time()
                    eng.step()
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
                runs[threads].append((statistics.median(wall), statistics.median(cpu)))
    finally:
        if args.fifo:
            _fifo(False)
        if busy is not None:
            busy.kill()
    eng.close()
    print(
        f"decode step, {args.batch} x {args.context} tokens, bf16, `cpu` backend; median ms of "
        f"{args.steps} steps per run, {args.reps} runs per count, interleaved"
        + (" (SCHED_FIFO" + (f", competitor {args.competitor:.0%}" if busy else "") + ")")
        * args.fifo
    )
    print("| torch threads | wall ms per run | CPU ms per run |")
    print("|---:|---|---|")
    for threads, rs in runs.items():
        wall = " / ".join(f"{w * 1e3:.1f}" for w, _ in rs)
        cpu = " / ".join(f"{c * 1e3:.1f}" for _, c in rs)
        print(f"| {threads} | {wall} | {cpu} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

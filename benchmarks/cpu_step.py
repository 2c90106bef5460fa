"""The CPU engine's step costs by dtype and by attention backend, on the process CPU
clock (1 torch thread).

    python -m benchmarks.cpu_step [--context 2048] [--new 256] [--steps 32] [--reps 3]
    python -m benchmarks.cpu_step --decode-grid [--contexts 1024,4096,6144]
        [--batches 1,2,4] [--backends torch,cpu] [--dtype bfloat16] [--steps 16] [--reps 3]
    python -m benchmarks.cpu_step --prefill-grid [--contexts 0,2048,6144] [--news 256,512]
        [--backends torch,cpu] [--dtype bfloat16] [--reps 3]

What an agentic turn costs a CPU engine, without HTTP: prefill of `--new` tokens behind a
cached `--context`-token prefix (the common case: most of the prompt is reused), a cold
prefill of `--context` tokens, and one decode step at batch 1 and 2 with `--context`
tokens of KV each. Rows: float32 (the exactness reference), bfloat16 with plain F.linear
and bfloat16 with oneDNN-packed projection weights (engine/models/cpu_gemm.py, the
default in bf16 on CPU). CPU time, not wall time: on a shared machine the neighbours
change the wall clock by 2-3x but hardly the work; the best of `--reps` counts.

`--decode-grid`: decode ms per step for every (context, batch) with each attention
backend ("torch": the reference, gathering each sequence's KV per layer per step; "cpu":
the in-place kernel, engine/attention/cpu_paged.py). One engine prefills each cell's
sequences once; then the model's attention backend is swapped between runs of `--steps`
decode steps (torch, cpu, torch, cpu, ...) so a noisy neighbour affects both alike, and
the median of `--reps` runs counts. Prefill of `--new` tokens behind the largest cached
context is reported per backend too.

`--prefill-grid`: prefill of a chunk of `new` tokens behind a cached `context`-token
prefix, for every (context, new), with each attention backend ("torch": the reference,
gathering the prefix and running SDPA with a lower-right causal mask; "cpu": the in-place
prefill kernel): the whole model's tok/s (one engine; the prefix cached once, then fresh
chunks behind it, backends interleaved, median of `--reps`), and one layer's attention
alone in ms (SmolLM2's 9 query heads over 3 KV heads of 64 dims, block size 16, shuffled
blocks; the step plan built once as for layers 2..30).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, get_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.models.llama import LINEAR_WEIGHTS
from protocol.sampling import SamplingParams

MODEL = "builtin:smollm2-135m-instruct"


def _unpack(eng: LLMEngine) -> None:
    runner = eng.runner
    assert isinstance(runner, ModelRunner)  # one process, the whole model
    for module in runner.model.modules():
        for name in LINEAR_WEIGHTS:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor) and hasattr(w, "_packed"):
                del w._packed


def _cpu(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(eng: LLMEngine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = eng.info.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = prompt(args.context)
    eng.generate([prefix], one)  # the prefix is now cached
    warm = _cpu(lambda: eng.generate([prefix + prompt(args.new)], one))
    eng.reset_prefix_cache()
    cold = _cpu(lambda: eng.generate([prompt(args.context)], one))
    out = {
        "prefill_behind_prefix_tok_s": args.new / warm,
        "prefill_cold_tok_s": args.context / cold,
    }
    for batch in (1, 2):
        params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(prompt(args.context), params, f"d{seed}-{batch}-{i}")
        sched = eng.scheduler
        while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            eng.step()
        eng.step()  # every request decoding now
        t = _cpu(lambda: [eng.step() for _ in range(args.steps)])
        out[f"decode_b{batch}_ms"] = 1000 * t / args.steps
        while eng.has_unfinished():
            eng.step()
    return out


def _set_backend(eng: LLMEngine, backend: AttentionBackend) -> None:
    runner = eng.runner
    assert isinstance(runner, ModelRunner)
    runner.backend = backend
    for module in runner.model.modules():
        if hasattr(module, "backend"):
            module.backend = backend


def decode_grid(args: argparse.Namespace) -> int:
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    names = args.backends.split(",")
    backends = {name: get_backend(name) for name in names}
    need = max(contexts) * max(batches) + 4096
    eng = LLMEngine.from_spec(
        MODEL,
        EngineConfig(
            dtype=args.dtype,
            attention_backend=names[0],
            num_blocks=-(-need // 16) + 64,
            max_num_batched_tokens=2048,
        ),
    )
    vocab = eng.info.config.vocab_size
    rng = random.Random(0)
    samples: dict[tuple[str, int, int], list[float]] = {}
    sched = eng.scheduler
    for context in contexts:
        for batch in batches:
            steps = args.reps * len(names) * args.steps
            params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                ids = [rng.randrange(100, vocab) for _ in range(context)]
                eng.add_request(ids, params, f"g{context}-{batch}-{i}")
            while sched.waiting or any(
                r.num_computed_tokens < r.num_tokens - 1 for r in sched.running
            ):
                eng.step()
            eng.step()  # every request decoding now
            for _ in range(args.reps):
                for name, backend in backends.items():
                    _set_backend(eng, backend)
                    t = _cpu(lambda: [eng.step() for _ in range(args.steps)])
                    samples.setdefault((name, context, batch), []).append(1000 * t / args.steps)
            while eng.has_unfinished():
                eng.step()
            eng.reset_prefix_cache()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = [rng.randrange(100, vocab) for _ in range(max(contexts))]
    eng.generate([prefix], one)  # cached from here on
    prefill: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, backend in backends.items():
            _set_backend(eng, backend)
            new = [rng.randrange(100, vocab) for _ in range(args.new)]
            t = _cpu(lambda n=new: eng.generate([prefix + n], one))
            prefill.setdefault(name, []).append(args.new / t)
    eng.close()
    print(
        f"{args.dtype}, decode ms per step by context x batch (CPU clock, 1 torch thread, "
        f"median of {args.reps} interleaved runs of {args.steps} steps)"
    )
    cols = [(c, b) for c in contexts for b in batches]
    print(
        "| backend | "
        + " | ".join(f"{c} x{b}" for c, b in cols)
        + f" | prefill {args.new} behind {max(contexts)}, tok/s |"
    )
    print("|---|" + "---:|" * (len(cols) + 1))
    for name in names:
        cells = [f"{statistics.median(samples[(name, c, b)]):.1f}" for c, b in cols]
        print(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(prefill[name]):,.0f} |")
    return 0


def _layer_attention_ms(name: str, context: int, new: int, dtype: torch.dtype, reps: int) -> float:
    """One layer's attention of `new` tokens behind `context` cached ones, ms (median)."""
    hq, hkv, d, bs = 9, 3, 64, 16
    blocks = -(-(context + new) // bs)
    order = torch.randperm(blocks + 8, generator=torch.Generator().manual_seed(0))
    table = order[:blocks].to(torch.int32)
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(context, context + new)])
    cache = torch.randn(2, blocks + 8, bs, hkv, d).to(dtype)
    q, k, v = (torch.randn(new, h, d).to(dtype) for h in (hq, hkv, hkv))
    backend = get_backend(name)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=[0, new],
        seq_lens=[context + new],
        block_tables=table[None],
    )
    backend.forward(q, k, v, cache, meta, d**-0.5)  # builds the step plan, warms up
    times = [_cpu(lambda: backend.forward(q, k, v, cache, meta, d**-0.5)) for _ in range(reps)]
    return 1000 * statistics.median(times)


def prefill_grid(args: argparse.Namespace) -> int:
    contexts = [int(c) for c in args.contexts.split(",")]
    news = [int(n) for n in args.news.split(",")]
    names = args.backends.split(",")
    backends = {name: get_backend(name) for name in names}
    need = max(contexts) + args.reps * len(names) * sum(news) + 4096
    eng = LLMEngine.from_spec(
        MODEL,
        EngineConfig(
            dtype=args.dtype,
            attention_backend=names[0],
            num_blocks=-(-need // 16) + 64,
            max_num_batched_tokens=max(news),
        ),
    )
    vocab = eng.info.config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tok_s: dict[tuple[str, int, int], list[float]] = {}
    for context in contexts:
        prefix = [rng.randrange(100, vocab) for _ in range(context)]
        if prefix:
            eng.generate([prefix], one)  # cached from here on
        for new in news:
            for _ in range(args.reps):
                for name, backend in backends.items():
                    _set_backend(eng, backend)
                    ids = prefix + [rng.randrange(100, vocab) for _ in range(new)]
                    t = _cpu(lambda ids=ids: eng.generate([ids], one))
                    tok_s.setdefault((name, context, new), []).append(new / t)
        eng.reset_prefix_cache()
    eng.close()
    dtype = getattr(torch, args.dtype)
    cols = [(c, n) for c in contexts for n in news]
    print(
        f"{args.dtype}, prefill of `new` tokens behind a cached `context` (CPU clock, "
        f"1 torch thread, median of {args.reps} interleaved runs)"
    )
    print("| | backend | " + " | ".join(f"{n} behind {c}" for c, n in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for name in names:
        cells = [f"{statistics.median(tok_s[(name, c, n)]):,.0f}" for c, n in cols]
        print(f"| model tok/s | {name} | " + " | ".join(cells) + " |")
    for name in names:
        cells = [f"{_layer_attention_ms(name, c, n, dtype, args.reps):.1f}" for c, n in cols]
        print(f"| one layer's attention, ms | {name} | " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_step", description=__doc__)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-grid", action="store_true")
    ap.add_argument("--prefill-grid", action="store_true")
    ap.add_argument(
        "--contexts", default=None, help="default 1024,4096,6144 (prefill: 0,2048,6144)"
    )
    ap.add_argument("--news", default="256,512")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.prefill_grid:
        args.contexts = args.contexts or "0,2048,6144"
        return prefill_grid(args)
    if args.decode_grid:
        args.contexts = args.contexts or "1024,4096,6144"
        return decode_grid(args)
    rows = []
    for label, dtype, packed in (
        ("float32", "float32", False),
        ("bfloat16 F.linear", "bfloat16", False),
        ("bfloat16 packed", "bfloat16", True),
    ):
        eng = LLMEngine.from_spec(MODEL, EngineConfig(dtype=dtype, kv_cache_bytes=1024**3))
        if not packed:
            _unpack(eng)
        best: dict[str, float] = {}
        for rep in range(args.reps):
            eng.reset_prefix_cache()
            for k, v in measure(eng, args, rep).items():
                better = max if k.endswith("tok_s") else min
                best[k] = better(best.get(k, v), v)
        rows.append((label, best))
        eng.close()
    print(
        f"context {args.context}, {args.new} new tokens behind it, {args.steps} decode steps; "
        f"1 torch thread, process CPU clock, best of {args.reps}"
    )
    print(
        "| dtype | prefill behind prefix tok/s | cold prefill tok/s | decode b1 ms | decode b2 ms |"
    )
    print("|---|---:|---:|---:|---:|")
    for label, b in rows:
        print(
            f"| {label} | {b['prefill_behind_prefix_tok_s']:,.0f} | {b['prefill_cold_tok_s']:,.0f} "
            f"| {b['decode_b1_ms']:.1f} | {b['decode_b2_ms']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Greedy agreement of an fp8_e4m3 KV cache with the model-dtype KV cache, on CPU.

For N prompts x M greedy tokens it runs the same engine twice (kv_cache_dtype "auto",
then "fp8_e4m3") and reports:
  * identical: positions where both generated the same token (after a first difference
    the continuations drift apart, so this is a strict measure);
  * whole: prompts whose M tokens all agree; first diff: mean index of the first
    difference (M when none);
  * teacher-forced: fp8's next token given the auto run's own prefix, at each of the
    M positions (the per-step agreement, free of drift); next to it the auto engine's
    own teacher-forced agreement (below 100% where a prompt computed in one prefill
    rounds differently from the same tokens decoded one by one, e.g. in bfloat16).

    python -m benchmarks.kv_fp8_agreement [--model builtin:smollm2-135m-instruct]
        [--dtype bfloat16] [--prompts 16] [--tokens 32]
    python -m benchmarks.kv_fp8_agreement --model tiny-llama   # the tests' random Llama

Results: docs/kv_cache.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13,",
    "Explain why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "The three laws of thermodynamics are",
    "import numpy as np\nx = np.",
    "Question: What is 12 times 7?\nAnswer:",
    "My favourite recipe for pancakes is",
    "In 1492, Columbus",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "Translate to French: Good morning, how are you?",
    "A list of prime numbers: 2, 3, 5,",
    "Dear Sir or Madam,",
]


def _tiny_llama(cache: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer(cache / "tok")
    return str(make_tiny_model(cache / "tiny-llama", tok, "llama"))


def _prompts(engine, n: int, seed: int, natural: bool) -> list[list[int]]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    if natural:
        texts = [TEXTS[i % len(TEXTS)] for i in range(n)]
        return [engine.info.tokenizer.encode(t) for t in texts]
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def measure(model: str, dtype: str, n: int, m: int, seed: int) -> dict[str, float]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from protocol.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        cfg = EngineConfig(
            dtype=dtype, kv_cache_dtype=kv, max_num_seqs=64, max_num_batched_tokens=4096
        )
        engine = LLMEngine.from_spec(model, cfg)
        prompts = _prompts(engine, n, seed, natural=model.startswith("builtin:"))
        t0 = time.monotonic()
        out = [c.token_ids for c in engine.generate(prompts, greedy)]
        runs[kv] = (engine, prompts, out, time.monotonic() - t0)
    _, prompts, ref, _ = runs["auto"]
    fp8_engine, _, got, _ = runs["fp8_e4m3"]
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    firsts = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), m)
        for r, g in zip(ref, got, strict=True)
    ]
    forced = [p + r[:i] for p, r in zip(prompts, ref, strict=True) for i in range(m)]
    want = [r[i] for r in ref for i in range(m)]

    def forced_agreement(engine) -> float:  # type: ignore[no-untyped-def]
        engine.reset_prefix_cache()
        tf = [c.token_ids[0] for c in engine.generate(forced, one)]
        return sum(a == b for a, b in zip(tf, want, strict=True)) / len(want)

    return {
        "identical": same / (n * m),
        "whole": sum(f == m for f in firsts) / n,
        "first_diff": sum(firsts) / n,
        "teacher_forced": forced_agreement(fp8_engine),
        "auto_teacher_forced": forced_agreement(runs["auto"][0]),
        "auto_s": runs["auto"][3],
        "fp8_s": runs["fp8_e4m3"][3],
        "auto_bytes_per_token": runs["auto"][0].layout.bytes_per_token,
        "fp8_bytes_per_token": fp8_engine.layout.bytes_per_token,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = args.model
    if model == "tiny-llama":
        model = _tiny_llama(Path(tempfile.mkdtemp(prefix="kv-fp8-")))
    r = measure(model, args.dtype, args.prompts, args.tokens, args.seed)
    n = args.prompts * args.tokens
    print(
        f"{args.model} {args.dtype}, {args.prompts} prompts x {args.tokens} tokens: "
        f"identical {r['identical']:.1%} of {n}, whole {r['whole']:.0%} of prompts, "
        f"first diff at {r['first_diff']:.1f}, teacher-forced {r['teacher_forced']:.1%} "
        f"(auto itself {r['auto_teacher_forced']:.1%}); "
        f"KV bytes per token {r['auto_bytes_per_token']} -> {r['fp8_bytes_per_token']} "
        f"({r['auto_bytes_per_token'] / r['fp8_bytes_per_token']:.2f}x the tokens)"
    )


if __name__ == "__main__":
    main()

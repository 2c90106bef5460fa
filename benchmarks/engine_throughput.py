"""Engine vs transformers on CPU: prefill and decode tokens/s at batch 1 and 16.

    python -m benchmarks.engine_throughput [--model builtin:smollm2-135m-instruct]
        [--prompt-len 512] [--gen-len 64] [--reps 3]

Both run the same GGUF dequantized to float32, in this process, interleaved rep by rep so
background load hits them alike; the best rep counts (least disturbed by other load).
Correctness first: greedy tokens of both must match before anything is timed.
Prefill = a batch of prompt-len prompts to their first token (prompt tokens / s);
decode = a batch of 16-token prompts generating gen-len tokens each (generated tokens / s;
the short prompts make prefill negligible).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def _clock(cpu: bool) -> float:
    return time.process_time() if cpu else time.perf_counter()


CPU_CLOCK = False
"""--cpu-time: time with the process's CPU clock (one thread: the work done, blind to
other processes on a loaded machine) instead of the wall clock."""


def _ours(eng: LLMEngine, prompts: list[list[int]], gen: int) -> tuple[float, list[list[int]]]:
    eng.reset_prefix_cache()  # every rep computes its prompts from scratch
    t0 = _clock(CPU_CLOCK)
    outs = eng.generate(prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    return _clock(CPU_CLOCK) - t0, [o.token_ids for o in outs]


def _hf(model, prompts: list[list[int]], gen: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)
    t0 = _clock(CPU_CLOCK)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            pad_token_id=0,
        )
    return _clock(CPU_CLOCK) - t0, out[:, ids.shape[1] :].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for both")
    ap.add_argument("--cpu-time", action="store_true", help="time with the CPU clock (1 thread)")
    args = ap.parse_args()
    global CPU_CLOCK
    CPU_CLOCK = args.cpu_time
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    eng = LLMEngine.from_spec(args.model, EngineConfig(kv_cache_bytes=1024**3))
    src = eng.info.source
    if src.kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32)
    hf.eval()
    vocab = eng.info.config.vocab_size

    check = _prompts(2, 64, vocab, 0)
    _, a = _ours(eng, check, 16)
    _, b = _hf(hf, check, 16)
    if a != b:
        print("MISMATCH: engine and transformers disagree on greedy tokens", file=sys.stderr)
        return 1
    print(f"check: greedy tokens identical ({len(check)} prompts x 16 tokens)")
    _ours(eng, check, 2)  # warm both up at the shapes timed below
    _hf(hf, check, 2)

    rows = []
    impls = (
        ("kvserve", lambda p, g: _ours(eng, p, g)),
        ("transformers", lambda p, g: _hf(hf, p, g)),
    )
    for batch in (1, 16):
        long_prompts = _prompts(batch, args.prompt_len, vocab, batch)
        short_prompts = _prompts(batch, 16, vocab, 100 + batch)
        best: dict[str, list[float]] = {name: [0.0, 0.0] for name, _ in impls}
        for _ in range(args.reps):
            for name, fn in impls:
                t_prefill, _ = fn(long_prompts, 1)
                t_decode, _ = fn(short_prompts, args.gen_len)
                best[name][0] = max(best[name][0], batch * args.prompt_len / t_prefill)
                best[name][1] = max(best[name][1], batch * args.gen_len / t_decode)
        rows += [(name, batch, p, d) for name, (p, d) in best.items()]
    print(
        f"\nprefill: {args.prompt_len}-token prompts; decode: {args.gen_len} tokens after 16; "
        f"best of {args.reps}; torch threads {torch.get_num_threads()}; "
        f"{'CPU' if CPU_CLOCK else 'wall'} clock"
    )
    print(f"{'impl':<14}{'batch':>6}{'prefill tok/s':>16}{'decode tok/s':>15}")
    for name, batch, p, d in rows:
        print(f"{name:<14}{batch:>6}{p:>16.0f}{d:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine vs transformers on CPU: prefill and decode tokens/s at batch 1 and 16.

    python -m benchmarks.engine_throughput [--model builtin:smollm2-135m-instruct]
        [--prompt-len 512] [--gen-len 64] [--reps 3]

Both run the same GGUF dequantized to float32, in this process, interleaved rep by rep so
background load hits them alike. Correctness first: greedy tokens of both must match
before anything is timed. Prefill = time to first token for a batch of prompts (tokens
of all prompts / s); decode = generated tokens / s after the prompts are in (measured as
the difference between a gen-len run and a 1-token run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def _ours(eng: LLMEngine, prompts: list[list[int]], gen: int) -> tuple[float, list[list[int]]]:
    eng.reset_prefix_cache()  # every rep computes its prompts from scratch
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def _hf(model, prompts: list[list[int]], gen: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for both")
    args = ap.parse_args()
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
    for batch in (1, 16):
        prompts = _prompts(batch, args.prompt_len, vocab, batch)
        res: dict[str, dict[str, list[float]]] = {
            "kvserve": {"p": [], "d": []},
            "transformers": {"p": [], "d": []},
        }
        for _ in range(args.reps):
            for name, fn in (
                ("kvserve", lambda p, g: _ours(eng, p, g)),
                ("transformers", lambda p, g: _hf(hf, p, g)),
            ):
                t1, _ = fn(prompts, 1)
                tn, _ = fn(prompts, args.gen_len + 1)
                res[name]["p"].append(batch * args.prompt_len / t1)
                res[name]["d"].append(batch * args.gen_len / max(tn - t1, 1e-9))
        for name, r in res.items():
            rows.append((name, batch, statistics.median(r["p"]), statistics.median(r["d"])))
    print(
        f"\nprompt {args.prompt_len} tokens, {args.gen_len} generated, median of {args.reps}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'impl':<14}{'batch':>6}{'prefill tok/s':>16}{'decode tok/s':>15}")
    for name, batch, p, d in rows:
        print(f"{name:<14}{batch:>6}{p:>16.0f}{d:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

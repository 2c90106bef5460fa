"""Constrained-decoding overhead of the engine's sampler, per step and per token.

A batch of rows (default 16) of SmolLM2-sized logits (V = 49,152) is sampled step after
step at temperature 1 (seeded) with three setups, taking turns step by step:

    plain         no grammar
    json_schema   every row under a JSON schema (llguidance masks, engine/grammar.py)
    mixed         half the rows under the schema, half plain

Each grammar row's state advances with the token it sampled; a row whose JSON is
complete (EOS sampled) starts a fresh state, so every step computes real masks. The
overhead is the median step time minus plain's; per token = per step / batch. Logits are
seeded random (the model's forward pass is the same with or without a grammar, so it is
left out). The grammar engine's mask alone is timed too, and xgrammar's for the same
schema and tokens when it is installed (the measurement that chose llguidance).

    python -m benchmarks.constrained_decoding [--batch 16] [--steps 200] [--device cpu] [--threads 1]
        [--model builtin:smollm2-135m-instruct]   (an HF folder with SmolLM2's tokenizer and
                                                   config works too: no weights are read)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.hash_chain import cpu_name
from engine.grammar import GrammarCompiler, GrammarState, fill_bitmasks
from engine.sampler import Sampler, SamplingState
from modelinfo.info import load_model_info
from protocol.sampling import GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}


class Row:
    def __init__(self, compiler: GrammarCompiler | None, spec: GrammarSpec, seed: int) -> None:
        self.compiler, self.spec, self.seed = compiler, spec, seed
        self.tokens: list[int] = []
        self.grammar: GrammarState | None = None
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self.grammar = self.compiler.new_state(self.spec) if self.compiler else None


class Setup:
    """One setup's rows, sampler and logits source, stepped one step at a time."""

    def __init__(
        self, name: str, batch: int, device: torch.device, compiler: GrammarCompiler
    ) -> None:
        spec = GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
        constrained = [
            name == "json_schema" or (name == "mixed" and i % 2 == 0) for i in range(batch)
        ]
        self.name = name
        self.rows = [Row(compiler if c else None, spec, i) for i, c in enumerate(constrained)]
        self.sampler = Sampler(device=device, seed=0)
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.device = device
        self.times: list[float] = []
        self.done: list[list[int]] = []

    def step(self, eos: tuple[int, ...], vocab: int) -> None:
        logits = torch.randn(len(self.rows), vocab, generator=self.gen, device=self.device)
        states = [
            SamplingState(
                SamplingParams(temperature=1.0, seed=r.seed),
                len(r.tokens),
                None,
                eos,
                (),
                r.tokens,
                r.grammar,
            )
            for r in self.rows
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.sampler.sample(logits, states)
        self.times.append(time.perf_counter() - t0)
        for r, token in zip(self.rows, out.token_ids, strict=True):
            if token in eos or len(r.tokens) >= 120:
                if r.grammar is not None and token in eos:
                    self.done.append(r.tokens)
                r.reset()
            else:
                r.tokens.append(token)


def mask_only(compiler: GrammarCompiler, sequences: list[list[int]], vocab: int) -> float:
    """Median seconds of one row's llguidance mask over the given token sequences."""
    spec = GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
    times = []
    for seq in sequences:
        state = compiler.new_state(spec)
        for i in range(len(seq)):
            state.sync(seq[:i])
            t0 = time.perf_counter()
            fill_bitmasks(1, [(0, state, ())], vocab)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def xgrammar_mask_only(info: Any, sequences: list[list[int]], vocab: int) -> float | None:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return None
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=info.tokenizer.backend)
    tok = xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab, stop_token_ids=list(info.eos_token_ids)
    )
    compiled = xgr.GrammarCompiler(tok).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False
    )
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for seq in sequences:
        matcher = xgr.GrammarMatcher(compiled)
        for token in seq:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            if not matcher.accept_token(token):
                break
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)"
    )
    parser.add_argument(
        "--model", default="builtin:smollm2-135m-instruct", help="tokenizer + vocabulary source"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = load_model_info(args.model)
    vocab = info.config.vocab_size
    eos = tuple(info.eos_token_ids)
    compiler = GrammarCompiler(info.tokenizer, vocab, eos)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"device: {name}; torch threads {torch.get_num_threads()}; V = {vocab}")
    # The setups take turns step by step, so load from other processes on a shared
    # machine falls on all of them alike.
    setups = [Setup(n, args.batch, device, compiler) for n in ("plain", "json_schema", "mixed")]
    for step in range(args.steps + 1):
        for setup in setups:
            setup.step(eos, vocab)
        if step == 0:  # warm-up: the first compile, the tokenizer view
            for setup in setups:
                setup.times.clear()
    results = {}
    sequences: list[list[int]] = []
    for setup in setups:
        results[setup.name] = statistics.median(setup.times)
        sequences += setup.done
        print(f"{setup.name:12s} batch {args.batch}: {results[setup.name] * 1e3:7.3f} ms/step")
    for setup in ("json_schema", "mixed"):
        extra = results[setup] - results["plain"]
        print(
            f"overhead {setup:12s}: {extra * 1e3:7.3f} ms/step, "
            f"{extra / args.batch * 1e6:7.1f} us/token"
        )
    for seq in sequences[:3]:
        json.loads(info.tokenizer.decode(seq))  # the constrained rows made valid JSON
    print(f"completed JSON objects: {len(sequences)} (the first ones parse)")
    sample = sequences[:20]
    llg = mask_only(compiler, sample, vocab)
    print(f"llguidance mask, one row: {llg * 1e6:.1f} us (median over {len(sample)} objects)")
    xgr = xgrammar_mask_only(info, sample, vocab)
    if xgr is None:
        print("xgrammar: not installed")
    else:
        print(f"xgrammar mask, one row:   {xgr * 1e6:.1f} us (same tokens)")
    compiler.close()


if __name__ == "__main__":
    main()

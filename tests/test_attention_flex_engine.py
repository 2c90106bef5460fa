"""The "flex" backend inside the engine, on CPU: its compiled kernel replaced by the tile
simulator (tests/flex_simulator.py), so the plumbing around it (decode rows padded to
bucket sizes, mixed batches, prefill over a cached prefix through SDPA, device block
tables) gives the same greedy tokens as the torch reference backend."""

from __future__ import annotations

import random

import pytest
from flex_simulator import simulate_flex

from engine.attention import flex
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _outputs(eng: LLMEngine) -> list[list[int]]:
    shared = _prompt(70, 1)
    outs = [eng.generate([[*shared, 5]], GREEDY)[0].token_ids]
    hit = eng.generate([[*shared, 9, 9]], GREEDY)[0]  # 64 cached tokens, then prefill
    assert hit.num_cached_tokens == 64
    outs.append(hit.token_ids)
    prompts = [_prompt(n, 10 + n) for n in (1, 17, 40, 5, 23)]
    outs += [o.token_ids for o in eng.generate(prompts, GREEDY)]
    return outs


def test_flex_engine_with_simulated_kernel_equals_torch(
    tiny_llama_dir, weights_cache_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    def config(backend: str) -> EngineConfig:
        return EngineConfig(
            cache_dir=weights_cache_dir,
            num_blocks=48,
            max_num_batched_tokens=29,  # chunked prefills beside decodes
            attention_backend=backend,
        )

    ref = _outputs(LLMEngine.from_spec(str(tiny_llama_dir), config("torch")))
    monkeypatch.setattr(flex, "DEFAULT_KERNEL", simulate_flex)
    assert _outputs(LLMEngine.from_spec(str(tiny_llama_dir), config("flex"))) == ref

"""The builtin SmolLM2 through the engine with the "cpu" attention backend in float32:
greedy tokens identical to the "torch" reference backend's and to transformers', with
chunked prefill (a small step budget) so decode rows share steps with prefill chunks, and
with second turns whose prompts hit the prefix cache (their new tokens prefill behind a
cached prefix, in chunks)."""

from __future__ import annotations

import pytest
import torch
from test_engine_smollm2 import _prompt_ids, hf  # noqa: F401  (hf is a fixture)

from engine.attention.cpu_paged import CpuPagedAttentionBackend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protocol.sampling import SamplingParams


def _engine(backend: str, cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(
        "builtin:smollm2-135m-instruct",
        EngineConfig(cache_dir=cache_dir, attention_backend=backend, max_num_batched_tokens=48),
    )


@pytest.fixture(scope="module")
def engines(weights_cache_dir: str):
    made = {name: _engine(name, weights_cache_dir) for name in ("cpu", "torch")}
    yield made
    for e in made.values():
        e.close()


def test_greedy_tokens_match_reference_and_transformers(engines, hf) -> None:  # noqa: F811
    cpu = engines["cpu"]
    runner = cpu.runner
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.backend, CpuPagedAttentionBackend) and runner.backend.kernel
    _, model = hf
    prompts = _prompt_ids(cpu, hf)
    # a longer prompt: its chunks run in the same steps as the others' decode rows
    prompts.append((prompts[1] * 12)[:300])
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
    ours = [o.token_ids for o in cpu.generate(prompts, params)]
    ref = [o.token_ids for o in engines["torch"].generate(prompts, params)]
    assert ours == ref
    eos = list(cpu.info.eos_token_ids)
    for p, toks in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + toks[:-1]])).logits[0].float()
        steps = logits[len(p) - 1 :].clone()
        steps[:, eos] = float("-inf")  # min_tokens masks EOS
        assert steps.argmax(-1).tolist() == toks


def _check_transformers(model, eos: list[int], prompts, outs) -> None:  # type: ignore[no-untyped-def]
    for p, toks in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + toks[:-1]])).logits[0].float()
        steps = logits[len(p) - 1 :].clone()
        steps[:, eos] = float("-inf")  # min_tokens masks EOS
        assert steps.argmax(-1).tolist() == toks


def test_second_turns_behind_a_cached_prefix_match(engines, hf, monkeypatch) -> None:  # noqa: F811
    """Turn 1, then turn 2 = turn 1's prompt + its answer + a follow-up of 60 or 100 tokens:
    the prefix cache serves turn 1's blocks, the follow-up prefills behind them in chunks
    of the 48-token step budget (through the prefill kernel, counted), and the greedy
    tokens equal the reference backend's and transformers'."""
    from engine.attention import cpu_kernel

    calls = []
    kernel = cpu_kernel.prefill
    monkeypatch.setattr(cpu_kernel, "prefill", lambda *a: calls.append(1) or kernel(*a))
    cpu, ref_engine = engines["cpu"], engines["torch"]
    _, model = hf
    prompts = _prompt_ids(cpu, hf)[1:3]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    follow = [(prompts[1 - i] * 8)[: 60 + 40 * i] for i in range(2)]
    turns = []
    for engine in (cpu, ref_engine):
        first = engine.generate(prompts, params)
        second_prompts = [
            p + o.token_ids + f for p, o, f in zip(prompts, first, follow, strict=True)
        ]
        second = engine.generate(second_prompts, params)
        turns.append(([o.token_ids for o in first], [o.token_ids for o in second]))
        assert all(o.num_cached_tokens >= 16 for o in second), [o.num_cached_tokens for o in second]
    assert calls
    assert turns[0] == turns[1]
    eos = list(cpu.info.eos_token_ids)
    _check_transformers(model, eos, second_prompts, turns[0][1])

"""The builtin SmolLM2 through the engine with the "cpu" attention backend in float32:
greedy tokens identical to the "torch" reference backend's and to transformers', with
chunked prefill (a small step budget) so decode rows share steps with prefill chunks."""

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
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
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

"""The engine's correctness checks on CUDA (run on the lent GPU machine: pytest -m gpu).

Tiny random Llama / Qwen2 / Qwen3 models in float32 on the GPU: greedy tokens equal to
transformers on the same GPU, and the paged-cache paths (prefix hit, chunked prefill,
mixed batch, preemption) equal a cold single-request run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _engine(path: Path, cache: str, **kw) -> LLMEngine:
    return LLMEngine.from_spec(str(path), EngineConfig(device="cuda", cache_dir=cache, **kw))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_on_cuda(arch, tmp_path, tiny_tokenizer_dir, weights_cache_dir):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, tiny_tokenizer_dir, arch)
    eng = _engine(path, weights_cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    prompts = [_prompt(n, n) for n in (5, 40, 130)]
    ours = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        assert o.token_ids == ref[0, len(p) :].tolist()


def test_paged_paths_equal_cold_on_cuda(tiny_llama_dir, weights_cache_dir):
    cold = _engine(tiny_llama_dir, weights_cache_dir, enable_prefix_caching=False)

    def alone(p: list[int]) -> list[int]:
        return cold.generate([p], GREEDY)[0].token_ids

    eng = _engine(tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=37)
    shared = _prompt(200, 1)
    eng.generate([[*shared, 5]], GREEDY)
    p = shared + _prompt(20, 2)
    hit = eng.generate([p], GREEDY)[0]
    assert hit.num_cached_tokens == 192 and hit.token_ids == alone(p)

    prompts = [_prompt(n, 10 + n) for n in (1, 17, 64, 150)]
    for q, o in zip(prompts, eng.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == alone(q)

    tight = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=24, max_num_batched_tokens=64)
    prompts = [_prompt(60 + 10 * i, 40 + i) for i in range(6)]
    outs = tight.generate(prompts, GREEDY)
    assert tight.counters.preemptions > 0
    for q, o in zip(prompts, outs, strict=True):
        assert o.token_ids == alone(q)

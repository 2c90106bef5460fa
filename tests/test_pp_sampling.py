"""A prefill pipeline samples with every rule the single-process engine applies: the last
stage gets the prompt and output tokens the penalties read and compiles the request's
grammar itself (stages are real processes over gloo, the tiny parallel model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.launch import generate_parallel
from protocol.sampling import GrammarSpec, SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_pipeline_applies_penalties_bias_and_grammar_like_one_process(
    tiny_parallel_dir: Path, weights_cache_dir: str
) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 40)]
    config = EngineConfig(cache_dir=weights_cache_dir, num_blocks=64)
    engine = LLMEngine.from_spec(str(tiny_parallel_dir), config)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    base = [c.token_ids for c in engine.generate(prompts, plain)]
    params = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.7,
        frequency_penalty=0.8,
        presence_penalty=0.4,
        logit_bias=((base[0][0], -100.0),),
        grammar=GrammarSpec(kind="json_object"),
    )
    want = [c.token_ids for c in engine.generate(prompts, params)]
    engine.close()
    assert want != base  # the rules change this output
    text = engine.info.tokenizer.decode(want[0])
    assert text.startswith("{"), text  # the grammar held
    got = generate_parallel(str(tiny_parallel_dir), config, prompts, params, pp=2)
    assert got == want

"""Parallel engines (engine/parallel/) against the single-process engine and transformers,
each rank a real process over gloo: prefill pipelines and decode TP x DCP must give
token-identical greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.launch import generate_parallel
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [5, 37, 70, 16]
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_parallel_dir: Path, prompts, weights_cache_dir: str) -> list[list[int]]:
    engine = LLMEngine.from_spec(str(tiny_parallel_dir), EngineConfig(cache_dir=weights_cache_dir))
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_parallel_dir), torch_dtype=torch.float32)
    for p, w in zip(prompts, want, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out[0, len(p) :].tolist() == w, "single-process engine differs from transformers"
    return want


def _config(cache_dir: str, **kw) -> EngineConfig:
    base = dict(cache_dir=cache_dir, block_size=4, num_blocks=256, max_num_batched_tokens=32)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tp", "dcp"), [(2, 2), (2, 1)])
def test_decode_tp_dcp_matches_single_process(
    tiny_parallel_dir, prompts, reference, weights_cache_dir, tp, dcp
):
    got = generate_parallel(
        str(tiny_parallel_dir), _config(weights_cache_dir), prompts, PARAMS, tp=tp, dcp=dcp
    )
    assert got == reference


def test_prefill_pipeline_matches_single_process(
    tiny_parallel_dir, prompts, reference, weights_cache_dir
):
    # A 32-token budget splits the longer prompts into chunks that fill the pipeline.
    got = generate_parallel(
        str(tiny_parallel_dir),
        _config(weights_cache_dir),
        prompts,
        PARAMS,
        pp=2,
        layer_split=(3, 1),
    )
    assert got == reference


def test_kv_heads_replicated_when_ranks_outnumber_them(
    tmp_path_factory, tiny_tokenizer_dir, weights_cache_dir
):
    # One KV head, TP 2: each rank holds a copy of it and half of the query heads (vLLM's
    # replication of KV heads).
    from conftest import make_tiny_model

    model = make_tiny_model(
        tmp_path_factory.mktemp("tiny-mqa"),
        tiny_tokenizer_dir,
        "llama",
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 41)]
    engine = LLMEngine.from_spec(str(model), EngineConfig(cache_dir=weights_cache_dir))
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    got = generate_parallel(str(model), _config(weights_cache_dir), prompts, PARAMS, tp=2)
    assert got == want

"""DeepSeek (MLA) through the parallel engines, each rank a real process over gloo: a
prefill pipeline (PP 2) and decode TP 2 x DCP 2 (the latent whole on every rank, tokens
striped over the DCP pair, query heads split over the groups) give the single-process
engine's greedy tokens, which are transformers' own; with an fp8_e4m3 KV cache (each
latent entry a row of fp8 values and its scale) both equal the single process with fp8
KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mla_model import make_tiny_deepseek

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.launch import generate_parallel
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(
    scope="module",
    params=["deepseek_v2", pytest.param("deepseek_v3", marks=pytest.mark.slow)],
)
def mla_model(request, tmp_path_factory, tiny_tokenizer_dir: Path, weights_cache_dir: str):
    """(folder, prompts, the single-process engine's tokens, checked against transformers).
    V3 (plain q_proj, sigmoid routing with score bias) is `slow`: V2 covers the MLA path."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_deepseek(folder, request.param, tiny_tokenizer_dir, vocab_size=49152)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 37, 16)]
    engine = LLMEngine.from_spec(str(folder), EngineConfig(cache_dir=weights_cache_dir))
    assert engine.layout.kind == "mla" and engine.layout.num_parts == 1
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    for p, w in zip(prompts, want, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert out[0, len(p) :].tolist() == w, "single-process engine differs from transformers"
    return folder, prompts, want


def _config(cache_dir: str, kv: str = "auto") -> EngineConfig:
    # A 16-token budget splits the 37-token prompt into chunks that fill the pipeline.
    return EngineConfig(
        cache_dir=cache_dir,
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=16,
        kv_cache_dtype=kv,
    )


def test_mla_prefill_pipeline(mla_model, weights_cache_dir: str) -> None:
    folder, prompts, want = mla_model
    got = generate_parallel(
        str(folder), _config(weights_cache_dir), prompts, PARAMS, pp=2, layer_split=(2, 1)
    )
    assert got == want


@pytest.mark.parametrize(("tp", "dcp"), [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_mla_decode_tp_dcp(mla_model, weights_cache_dir: str, tp: int, dcp: int) -> None:
    folder, prompts, want = mla_model
    got = generate_parallel(
        str(folder), _config(weights_cache_dir), prompts, PARAMS, tp=tp, dcp=dcp
    )
    assert got == want


@pytest.mark.parametrize(
    ("tp", "dcp", "pp"),
    [(2, 2, 1), pytest.param(1, 1, 2, marks=pytest.mark.slow)],
    ids=["tp2-dcp2", "pp2"],
)
def test_mla_fp8_kv_layouts_match_single_process_fp8(
    mla_model, weights_cache_dir: str, tp: int, dcp: int, pp: int
) -> None:
    folder, prompts, _ = mla_model
    config = EngineConfig(cache_dir=weights_cache_dir, kv_cache_dtype="fp8_e4m3")
    engine = LLMEngine.from_spec(str(folder), config)
    assert engine.layout.row_width == engine.layout.head_dim + 4  # the latent + its scale
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    got = generate_parallel(
        str(folder),
        _config(weights_cache_dir, "fp8_e4m3"),
        prompts,
        PARAMS,
        tp=tp,
        dcp=dcp,
        pp=pp,
        layer_split=(2, 1) if pp == 2 else None,
    )
    assert got == want

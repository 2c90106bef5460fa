"""End to end on an MLA model (`kvserve up`, real processes, Mooncake tcp): a tiny random
DeepSeek-V2 whose KV is one latent entry per token and layer.

  * a PP 2 prefill hands its latent to a TP 2 x DCP 2 decode instance: every stage sends
    each rank its token stripe of the whole latent (one head: every TP group holds it),
    exactly num_parts (1) x latent bytes per token and layer, and the greedy tokens equal
    the single-process engine's, which transformers picks too;
  * with a shared pool, a prompt is prefilled and handed off, then after a prefix-cache
    reset restores its full chunks from the pool and gives the same text.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from cluster_harness import Cluster, start_cluster
from model_e2e_check import check_handoff_and_pool_restore
from parallel_harness import check_flows, flow_metrics, run_pair_batch, start_parallel_cluster
from test_mla_model import make_tiny_deepseek

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(900)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LATENT_BYTES = (32 + 8) * 4  # kv_lora_rank + qk_rope_head_dim, float32


@pytest.fixture(scope="module")
def mla(tmp_path_factory, tiny_tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp("deepseek-v2-e2e")
    hf = make_tiny_deepseek(folder, "deepseek_v2", tiny_tokenizer_dir, vocab_size=49152)
    return folder, hf


def test_pp2_prefill_to_tp2_dcp2_decode(mla, tmp_path_factory, weights_cache_dir: str) -> None:
    folder, hf = mla
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 45, 100)]
    ref = LLMEngine.from_spec(str(folder), EngineConfig(cache_dir=weights_cache_dir))
    want = [c.token_ids for c in ref.generate(prompts, PARAMS)]
    for p, w in zip(prompts, want, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert out[0, len(p) :].tolist() == w, "single-process engine differs from transformers"
    c = start_parallel_cluster(
        tmp_path_factory.mktemp("mla-parallel"),
        str(folder),
        cache_dir=weights_cache_dir,
        prefill={"pp2": {"pipeline_parallel": 2, "layer_split": [2, 1]}},
        decode={"tp2dcp2": {"tensor_parallel": 2, "decode_context_parallel": 2}},
    )
    try:
        before = flow_metrics(c.urls["pp2"], c.urls["tp2dcp2"])
        results = run_pair_batch(
            c.urls["pp2"], c.urls["tp2dcp2"], prompts, PARAMS, "mla", c.headers
        )
        assert [r.tokens for r in results] == want
        for r in results:
            assert len(r.ready.landing) == 2
            for info in r.ready.landing:
                assert info.layout.kind == "mla" and info.layout.num_kv_heads == 1
                assert (info.kv_head_start, info.layout.bytes_per_token_per_layer) == (
                    0,
                    LATENT_BYTES,
                )
        deadline = time.monotonic() + 10
        while True:  # flows close after the tokens
            after = flow_metrics(c.urls["pp2"], c.urls["tp2dcp2"])
            try:
                check_flows(before, after, results, (2, 1))
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        c.down()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mla, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e-mla"), str(mla[0]), cache_dir=weights_cache_dir, pool=True
    )
    yield c
    res = c.down()
    assert res.returncode == 0, res.stderr


def test_mla_handoff_and_pool_restore_match_single_process(
    cluster: Cluster, mla, weights_cache_dir: str
) -> None:
    folder, hf = mla
    words = ["latent", "rope", "absorb", "pool"]
    check_handoff_and_pool_restore(cluster, folder, hf, words, weights_cache_dir)

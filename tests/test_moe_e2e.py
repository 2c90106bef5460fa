"""End to end on a mixture-of-experts model: `kvserve up` with a shared pool on a tiny
random Glm4Moe (sigmoid grouped routing, shared expert, partial RoPE). Every request is
prefilled on the prefill instance and handed to the decode instance over Mooncake tcp;
after a prefix-cache reset the same prompt restores its full chunks from the pool. Greedy
output equals the single-process engine's, whose tokens transformers picks too."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch
from cluster_harness import Cluster, start_cluster
from test_moe_model import make_tiny_moe

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
CHUNK = 256


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tiny_tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp("glm4-moe")
    hf = make_tiny_moe(folder, "glm4_moe", tiny_tokenizer_dir, vocab_size=49152)
    return folder, hf


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moe, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e-moe"), str(moe[0]), cache_dir=weights_cache_dir, pool=True
    )
    yield c
    res = c.down()
    assert res.returncode == 0, res.stderr


def test_moe_handoff_and_pool_restore_match_single_process(
    cluster: Cluster, moe, weights_cache_dir: str
) -> None:
    folder, hf = moe
    ref = LLMEngine.from_spec(str(folder), EngineConfig(cache_dir=weights_cache_dir))
    rng = random.Random(5)
    prompt = " ".join(rng.choice(["expert", "router", "token", "pool"]) for _ in range(70))
    ids = ref.info.tokenizer.encode(prompt)
    assert len(ids) > CHUNK
    want = ref.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():  # transformers picks the same tokens, teacher-forced
        logits = hf(torch.tensor([ids + want.token_ids[:-1]])).logits[0, len(ids) - 1 :]
    assert logits.argmax(-1).tolist() == want.token_ids

    client = openai.OpenAI(base_url=cluster.api_base, api_key="unused", max_retries=0, timeout=60)

    def ask() -> dict:
        got = client.completions.create(
            model=cluster.served_name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == 8
        return got.usage.prompt_tokens_details.model_dump()

    decoded_before = _metric(cluster.decode_url, "kvserve_generated_tokens_total")
    first = ask()
    assert first["pool_tokens"] == 0 and first["computed_tokens"] == len(ids)
    # The decode instance generated the tokens from the handed-off KV.
    assert _metric(cluster.decode_url, "kvserve_generated_tokens_total") > decoded_before
    r = httpx.post(cluster.router_url + "/v1/admin/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    again = ask()
    assert again["gpu_tokens"] == 0
    assert again["pool_tokens"] == (len(ids) - 1) // CHUNK * CHUNK

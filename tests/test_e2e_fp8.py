"""End to end with an fp8_e4m3 KV cache: `kvserve up` of a pool (master + store), a
prefill and a decode instance and the router, on a tiny random Llama, every process with
kv_cache_dtype fp8_e4m3. A multi-turn session restores its history from the pool after
every prefix-cache reset and hands its KV to decode; each turn's output equals a cold
single-process engine with fp8 KV, and what prefill hands off is exactly the prompt's fp8
rows with their scales (bytes per token of the fp8 layout)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai
import pytest
from cluster_harness import Cluster, metric_sum, start_cluster

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
CHUNK = 256
FP8 = "fp8_e4m3"


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    config = EngineConfig(cache_dir=weights_cache_dir, kv_cache_dtype=FP8)
    return LLMEngine.from_spec(str(tiny_llama_dir), config)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("fp8"),
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        name="e2e-fp8",
        extra={"kv_cache_dtype": FP8},
        pool=True,
        prefill={"pool_buffer_memory": "8MiB"},
    )
    yield c
    c.stop()


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["agent", "tool", "cache", "token", "block", "router", "decode", "pool", "turn"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_session_restores_from_the_pool_and_hands_off_fp8_kv(cluster: Cluster, reference):
    client = openai.OpenAI(base_url=cluster.api_base, api_key="unused", max_retries=0, timeout=60)
    per_token = reference.layout.bytes_per_token  # 3 layers x K, V x 2 heads x (16 + 4) B
    assert reference.layout.cache_dtype == FP8 and per_token == 240
    text = _words(1, 150)
    prev_len = 0
    for k in range(3):
        r = httpx.post(cluster.router_url + "/v1/admin/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text
        if k:
            text += " " + _words(100 + k, 60)
        ids = reference.info.tokenizer.encode(text)
        want = reference.generate(
            [ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )[0]
        sent = metric_sum(cluster.prefill_url, "kvserve_handoff_bytes_total")
        got = client.completions.create(
            model=cluster.served_name,
            prompt=text,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.text, f"turn {k}: differs from the fp8 engine"
        assert got.usage is not None and got.usage.prompt_tokens_details is not None
        details = got.usage.prompt_tokens_details.model_dump()
        assert details["gpu_tokens"] == 0
        # every full chunk of the previous prompt comes back from the pool
        assert details["pool_tokens"] == min(prev_len // CHUNK, (len(ids) - 1) // CHUNK) * CHUNK
        if k:
            assert details["pool_tokens"] > 0
        # the whole prompt's KV went to decode as fp8 rows with their scales
        delta = metric_sum(cluster.prefill_url, "kvserve_handoff_bytes_total") - sent
        assert delta == len(ids) * per_token, (delta, len(ids))
        text += got.choices[0].text
        prev_len = len(ids)

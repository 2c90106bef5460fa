"""Prefill and decode on one GPU through `kvserve up`, KV handed over by cuda_ipc (-m gpu).

A tiny random Llama in float32 on GPU 0, both instances on it (the node opts in with
share_devices), decode's landing on the GPU and small enough (512 KiB: 128 KiB regions,
~170 tokens of this model) that long prompts stream through the ring many times. Greedy
completions through the router must equal the single-process engine on the same GPU.
"""

from __future__ import annotations

import random

import httpx
import pytest
from cluster_harness import start_cluster

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
MAX_TOKENS = 12


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 49152) for _ in range(n)]


def test_one_gpu_cluster_over_cuda_ipc_is_token_identical(
    tmp_path, tiny_llama_dir, weights_cache_dir
):
    prompts = [_prompt(n, n) for n in (7, 300, 1500)]
    ref = LLMEngine.from_spec(
        str(tiny_llama_dir), EngineConfig(device="cuda", cache_dir=weights_cache_dir)
    ).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    node = {"name": "local", "host": "127.0.0.1", "share_devices": True}
    c = start_cluster(
        tmp_path,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        extra={"nodes": [node]},
        prefill={"devices": [0], "kv_cache_memory": "256MiB"},
        decode={
            "devices": [0],
            "kv_cache_memory": "256MiB",
            "landing_memory": "512KiB",
            "transfer": {"protocol": "cuda_ipc"},
        },
    )
    try:
        for p, want in zip(prompts, ref, strict=True):
            r = httpx.post(
                c.api_base + "/completions",
                json={
                    "model": c.served_name,
                    "prompt": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=120,
                trust_env=False,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
        metrics = httpx.get(c.decode_url + "/metrics", timeout=5, trust_env=False).text
        ok = [
            line for line in metrics.splitlines() if line.startswith("kvserve_handoff_flows_total")
        ]
        assert any('result="ok"' in line and not line.endswith(" 0.0") for line in ok), ok
        assert all(line.endswith(" 0.0") for line in ok if 'result="ok"' not in line), ok
    finally:
        c.down()

"""The end-to-end check shared by the model-family tests (MoE, MLA): through a running
`kvserve up` cluster with a shared pool, a prompt of more than one chunk is prefilled and
handed off to decode, then, after a prefix-cache reset, restores its full chunks from the
pool; both answers equal the single-process engine's greedy text, whose tokens transformers
picks too (teacher-forced)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import openai
import torch
from cluster_harness import Cluster

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

CHUNK = 256


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) at `url`/metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def check_handoff_and_pool_restore(
    cluster: Cluster, folder: Path, hf: torch.nn.Module, words: list[str], cache_dir: str
) -> None:
    ref = LLMEngine.from_spec(str(folder), EngineConfig(cache_dir=cache_dir))
    rng = random.Random(5)
    prompt = " ".join(rng.choice(words) for _ in range(70))
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

    decoded_before = metric(cluster.decode_url, "kvserve_generated_tokens_total")
    first = ask()
    assert first["pool_tokens"] == 0 and first["computed_tokens"] == len(ids)
    # The decode instance generated the tokens from the handed-off KV.
    assert metric(cluster.decode_url, "kvserve_generated_tokens_total") > decoded_before
    r = httpx.post(cluster.router_url + "/v1/admin/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    again = ask()
    assert again["gpu_tokens"] == 0
    assert again["pool_tokens"] == (len(ids) - 1) // CHUNK * CHUNK

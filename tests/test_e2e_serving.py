"""End to end: `kvserve up` on a tiny random Llama with real prefill and decode processes,
the real router and a real KV handoff over Mooncake tcp, driven by the official openai
client. Greedy output must equal the single-process engine's."""

from __future__ import annotations

import concurrent.futures as cf
import random
from pathlib import Path

import httpx
import openai
import pytest
from cluster_harness import Cluster, start_cluster, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e"), str(tiny_llama_dir), cache_dir=weights_cache_dir
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_base, api_key="unused", max_retries=0, timeout=60)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["agent", "tool", "cache", "token", "block", "router", "decode", "prefill", "pool"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _ref_text(ref: LLMEngine, ids: list[int], max_tokens: int) -> tuple[str, int]:
    out = ref.generate(
        [ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )[0]
    return out.text, len(out.token_ids)


def test_completion_matches_single_process(client, cluster, reference):
    prompt = _words(1, 40)
    ids = reference.info.tokenizer.encode(prompt)
    want, n = _ref_text(reference, ids, 16)
    got = client.completions.create(
        model=cluster.served_name,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == n == 16
    details = got.usage.prompt_tokens_details.model_dump()
    assert details["gpu_tokens"] + details["pool_tokens"] + details["computed_tokens"] == len(ids)


def test_chat_stream_equals_non_stream_and_reference(client, cluster, reference):
    messages = [{"role": "user", "content": _words(2, 30)}]
    text = reference.info.chat_template.render(messages, add_generation_prompt=True)
    ids = reference.info.tokenizer.encode(text, add_special_tokens=False)
    want, _ = _ref_text(reference, ids, 20)
    full = client.chat.completions.create(
        model=cluster.served_name,
        messages=messages,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].message.content == want
    chunks = list(
        client.chat.completions.create(
            model=cluster.served_name,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == 20
    assert usage.total_tokens == len(ids) + 20
    # The same prompt again: its full blocks come from the prefill instance's GPU cache.
    cached = usage.prompt_tokens_details.model_dump()
    assert cached["gpu_tokens"] == (len(ids) - 1) // 16 * 16
    assert cached["cached_tokens"] == cached["gpu_tokens"] + cached["pool_tokens"]
    assert cached["computed_tokens"] == len(ids) - cached["gpu_tokens"]


def test_sixteen_concurrent_streams(client, cluster, reference):
    prompts = [_words(100 + i, 5 + 7 * i) for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [
        c.text
        for c in reference.generate([reference.info.tokenizer.encode(p) for p in prompts], params)
    ]

    def one(p: str) -> str:
        stream = client.completions.create(
            model=cluster.served_name,
            prompt=p,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == want


def test_client_disconnect_frees_kv_and_landing(cluster):
    body = {
        "model": cluster.served_name,
        "prompt": _words(3, 50),
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", cluster.api_base + "/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        busy = cluster.status(cluster.decode_url)
        assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]

    def freed() -> bool:
        d, p = cluster.status(cluster.decode_url), cluster.status(cluster.prefill_url)
        return (
            d["num_running"] == 0
            and d["kv_blocks_free"] == d["kv_blocks_total"]
            and d["landing_bytes_used"] == 0
            and p["num_running"] == 0
        )

    assert wait_until(freed, timeout_s=1.0)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/chat/completions", b"{not json", 400),
        ("/chat/completions", {"model": "e2e-model", "messages": "hi"}, 400),
        (
            "/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
        ),
        ("/chat/completions", {"model": "e2e-model", "messages": []}, 400),
        ("/completions", {"model": "e2e-model", "prompt": "x", "max_tokens": 0}, 400),
        ("/completions", {"model": "e2e-model", "prompt": "x " * 5000, "max_tokens": 4}, 400),
        ("/completions", {"model": "e2e-model", "prompt": "x", "n": 17}, 400),
        ("/completions", {"model": "e2e-model", "prompt": "x", "temperature": "hot"}, 400),
    ],
)
def test_bad_input_gets_openai_4xx_and_server_keeps_serving(cluster, client, path, body, status):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(cluster.api_base + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = client.completions.create(model=cluster.served_name, prompt="hello", max_tokens=2)
    assert ok.choices[0].text is not None

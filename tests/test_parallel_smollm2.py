"""deploy/examples/local-parallel.yaml (PP2 prefill, TP2 x DCP2 decode, real SmolLM2) through
`kvserve up` and the router, on free ports: greedy output token-identical to the
single-process engine (tests/test_engine_smollm2.py ties that to transformers)."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import yaml
from cluster_harness import free_ports, internal_headers, kvserve
from parallel_harness import check_flows, flow_metrics, run_pair

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.parallel import even_layer_split
from protocol.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local-parallel.yaml"
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived " * 12,
]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, weights_cache_dir: str):
    tmp = tmp_path_factory.mktemp("smollm2-parallel")
    cfg = yaml.safe_load(EXAMPLE.read_text())
    router, prefill, decode = free_ports(3)
    cfg["router"]["port"] = router
    cfg["prefill"][0]["port"] = prefill
    cfg["decode"][0]["port"] = decode
    cfg["prefill"][0]["kv_cache_memory"] = "64MiB"
    cfg["prefill"][0]["max_batched_tokens"] = 64  # the long prompt streams in chunks
    cfg["decode"][0]["kv_cache_memory"] = "64MiB"
    cfg["decode"][0]["landing_memory"] = "32MiB"
    cfg["cache"]["weights_cache_dir"] = weights_cache_dir
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = tmp / "state"
    res = kvserve("up", "-c", str(config), "--detach", "--state-dir", str(state), timeout=600)
    assert res.returncode == 0, f"kvserve up failed:\n{res.stdout}\n{res.stderr}"
    yield {**cfg, "headers": internal_headers(state, cfg["name"])}
    res = kvserve("down", "-c", str(config), "--state-dir", str(state))
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def engine(weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(
        "builtin:smollm2-135m-instruct", EngineConfig(cache_dir=weights_cache_dir)
    )


def test_router_completions_equal_single_process(cluster, engine):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster['router']['port']}/v1", api_key="x", max_retries=0
    )
    for prompt in PROMPTS:
        want = engine.generate([engine.info.tokenizer.encode(prompt)], PARAMS)[0]
        got = client.completions.create(
            model=cluster["router"]["served_model_name"],
            prompt=prompt,
            max_tokens=PARAMS.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.text


def test_tokens_and_flows(cluster, engine):
    ids = engine.info.tokenizer.encode(PROMPTS[2])
    want = engine.generate([ids], PARAMS)[0].token_ids
    prefill_url = f"http://127.0.0.1:{cluster['prefill'][0]['port']}"
    decode_url = f"http://127.0.0.1:{cluster['decode'][0]['port']}"
    before = flow_metrics(prefill_url, decode_url)
    res = run_pair(prefill_url, decode_url, "smollm2-flows", ids, PARAMS, cluster["headers"])
    assert res.tokens == want
    assert len(res.ready.landing) == 2  # TP2 x DCP2: 2 stages x 2 ranks = 4 flows
    split = tuple(cluster["prefill"][0].get("layer_split") or even_layer_split(30, 2))
    deadline = time.monotonic() + 10
    while True:
        try:
            check_flows(before, flow_metrics(prefill_url, decode_url), [res], split)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

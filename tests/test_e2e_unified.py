"""End to end, the unified topology: `kvserve up` of a Mooncake master and store (tcp on
loopback), one unified instance (python -m unified_worker: prefill and decode in one
engine process, the pool connector, no handoff) and the real router, serving the real
SmolLM2-135M in float32.

Greedy output equals the single-process engine's, whose tokens are transformers' greedy
choice (one teacher-forced float32 forward); concurrent requests share steps (chunked
prefill beside decodes) and stay exact; a prompt restores its history from the pool after
the instance's own cache is reset and after the instance is killed and restarted; a store
killed mid-run fails no request; a request that fails in the engine fails alone; a client
that disconnects mid-stream frees its KV; usage,
/health, /metrics and the Prometheus scrape config speak of the unified role.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from cluster_harness import Cluster, free_ports, kvserve, launch, router_section, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.step_trace import ENV as STEP_TRACE_ENV
from engine.step_trace import RequestEvent, StepRecord, read_trace
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(900)
CHUNK = 256
MODEL = "builtin:smollm2-135m-instruct"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
POISON = 4242


class UnifiedCluster(Cluster):
    unified_url: str
    store_health: str
    trace_dir: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, weights_cache_dir: str):
    tmp = tmp_path_factory.mktemp("unified")
    p = free_ports(5)
    cfg = {
        "name": "e2e-unified",
        "model": MODEL,
        "dtype": "float32",
        "cache": {
            "block_size": 16,
            "chunk_size": CHUNK,
            "weights_cache_dir": weights_cache_dir,
            "prefill_order": "shortest",
        },
        "nodes": [{"name": "local", "host": "127.0.0.1"}],
        "pool": {
            "master": {"node": "local", "port": p[0], "metrics_port": p[1], "client_ttl_s": 3},
            "stores": [{"node": "local", "size": "256MiB", "metrics_port": p[2]}],
        },
        "unified": [
            {
                "name": "unified-0",
                "node": "local",
                "port": p[3],
                "devices": ["cpu"],
                # small: a long prompt is prefilled in chunks beside other requests' decodes
                "max_batched_tokens": 256,
                "max_num_seqs": 16,
                "kv_cache_memory": "96MiB",
                "pool_buffer_memory": "96MiB",
                # test-only: every step holding a request seeded POISON fails its forward
                "engine_faults": {"fail_seed": POISON, "place": "forward"},
                # the step trace (engine/step_trace.py) of every request of the module
                "env": {STEP_TRACE_ENV: str(tmp / "trace")},
            }
        ],
        "router": router_section(p[4], "e2e-model", timeout_s=120, policy="kv_aware"),
    }
    config, state = launch(tmp, cfg, timeout=600)
    c = UnifiedCluster(
        config,
        state,
        f"http://127.0.0.1:{p[4]}",
        prefill_url="",
        decode_url="",
        served_name="e2e-model",
        name="e2e-unified",
        pool_metrics_url=f"http://127.0.0.1:{p[1]}",
    )
    c.unified_url = f"http://127.0.0.1:{p[3]}"
    c.store_health = f"http://127.0.0.1:{p[2]}/health"
    c.trace_dir = tmp / "trace"
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(MODEL, EngineConfig(cache_dir=weights_cache_dir, dtype="float32"))


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_base, api_key="unused", max_retries=0, timeout=120)


def _prompt(ref: LLMEngine, seed: int, approx_tokens: int) -> list[int]:
    words = ["agent", "tool", "cache", "token", "block", "router", "decode", "prefill", "pool"]
    text = " ".join(words[(seed * 7 + i * 3 + i // 5) % len(words)] for i in range(approx_tokens))
    return ref.info.tokenizer.encode(f"Session {seed}: {text}")[:approx_tokens]


def _ref_out(ref: LLMEngine, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = ref.generate([ids], params)[0]
    return out.token_ids, out.text


def _ref_outs(
    ref: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], str]]:
    """The reference's greedy outputs of several prompts in one continuous batch (the
    engine's greedy tokens do not depend on the batch: tests/test_step_isolation.py)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [(o.token_ids, o.text) for o in ref.generate(prompts, params)]


def _ref_text(ref: LLMEngine, ids: list[int], max_tokens: int) -> str:
    return _ref_out(ref, ids, max_tokens)[1]


def _complete(client: openai.OpenAI, ids: list[int], max_tokens: int) -> tuple[str, dict]:
    """The completion's text and usage details (every prompt token counted once)."""
    got = client.completions.create(
        model="e2e-model",
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.usage is not None and got.usage.prompt_tokens_details is not None
    assert got.usage.completion_tokens == max_tokens
    details = got.usage.prompt_tokens_details.model_dump()
    assert details["gpu_tokens"] + details["pool_tokens"] + details["computed_tokens"] == len(ids)
    return got.choices[0].text, details


def test_greedy_matches_engine_and_transformers(cluster, client, reference, smollm2_hf):
    """Four requests at once (prefill chunks and decodes share steps): each one's tokens
    equal the single-process engine's, which are transformers' float32 greedy choice."""
    # 400 tokens: two chunks of the 256-token step budget, the second beside decodes
    prompts = [_prompt(reference, s, n) for s, n in ((1, 40), (2, 400), (3, 90), (4, 300))]
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ids: _complete(client, ids, 16)[0], prompts))
    want = _ref_outs(reference, prompts, 16)
    assert got == [text for _, text in want]

    hf = smollm2_hf[1]
    for ids, (out, _) in zip(prompts[:2], want[:2], strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0]
        greedy = logits[len(ids) - 1 : len(ids) + len(out) - 1].argmax(-1).tolist()
        assert greedy == out


def test_history_restored_from_the_pool_after_a_reset(cluster, client, reference):
    ids = _prompt(reference, 11, 530)  # two whole chunks and a rest
    want = _ref_text(reference, ids, 8)
    got, first = _complete(client, ids, 8)
    assert got == want and first["computed_tokens"] == len(ids)
    cluster.reset()  # the instance's own cache is empty: the pool has the whole chunks
    longer = ids + _prompt(reference, 12, 40)
    got, details = _complete(client, longer, 8)
    assert details["gpu_tokens"] == 0
    assert details["pool_tokens"] == len(ids) // CHUNK * CHUNK
    assert got == _ref_text(reference, longer, 8)
    url = cluster.unified_url
    assert cluster.metric(url, "kvserve_prompt_tokens_total", source="pool") >= 512
    assert cluster.metric(url, "kvserve_pool_hit_chunks_total") >= 2


@pytest.mark.slow  # CI time: docs/testing.md
def test_a_short_prompt_is_not_stuck_behind_a_long_prefill(cluster, client, reference):
    """cache.prefill_order shortest: a 1,200-token prompt prefills in 5 chunks of 256; a
    30-token prompt sent once it is running gets its first token before the long one does
    (in admission order it would wait for the whole prefill); both are greedy-exact."""
    long_ids, short_ids = _prompt(reference, 31, 1200), _prompt(reference, 32, 30)
    first: dict[str, float] = {}

    def stream(name: str, ids: list[int]) -> str:
        chunks = client.completions.create(
            model="e2e-model",
            prompt=ids,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        for c in chunks:
            if c.choices and c.choices[0].text:
                first.setdefault(name, time.monotonic())
                text += c.choices[0].text
        return text

    url = cluster.unified_url
    with cf.ThreadPoolExecutor(2) as pool:
        long_text = pool.submit(stream, "long", long_ids)
        assert wait_until(lambda: cluster.status(url)["num_running"] >= 1, 60, 0.02)
        short_text = pool.submit(stream, "short", short_ids)
        got = (long_text.result(), short_text.result())
    assert first["short"] < first["long"]
    assert got == (_ref_text(reference, long_ids, 6), _ref_text(reference, short_ids, 6))


def _kill(c: UnifiedCluster, name: str) -> int:
    pid = c.pids()[name]
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_restarted(c: UnifiedCluster, name: str, old_pid: int, health: str) -> None:
    def back() -> bool:
        try:
            return c.pids()[name] != old_pid and httpx.get(health, timeout=1).status_code == 200
        except (httpx.HTTPError, KeyError, OSError):
            return False

    assert wait_until(back, timeout_s=120, interval_s=0.5), f"{name} did not come back"


def test_restarted_instance_restores_from_the_pool(cluster, client, reference):
    ids = _prompt(reference, 21, 530)
    _complete(client, ids, 2)
    old = _kill(cluster, "unified-0")
    _wait_restarted(cluster, "unified-0", old, cluster.unified_url + "/health")

    def routable() -> bool:
        body = httpx.get(cluster.router_url + "/health", timeout=5).json()
        return body["unified"]["healthy"] == 1

    assert wait_until(routable, timeout_s=30, interval_s=0.2)
    got, details = _complete(client, ids, 8)
    assert details["pool_tokens"] == len(ids) // CHUNK * CHUNK and details["gpu_tokens"] == 0
    assert got == _ref_text(reference, ids, 8)


@pytest.mark.slow  # CI time: docs/testing.md
def test_store_killed_mid_run_fails_no_request(cluster, client, reference):
    prompts = [_prompt(reference, 30 + i, 300 + 40 * i) for i in range(4)]
    want = [text for _, text in _ref_outs(reference, prompts, 16)]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_complete, client, ids, 16) for ids in prompts]
        old = _kill(cluster, "pool-store-0")
        got = [f.result()[0] for f in futures]
    assert got == want
    cluster.reset()
    # the store's objects are gone: recomputed, exactly
    got2, _ = _complete(client, prompts[0], 8)
    assert got2 == _ref_text(reference, prompts[0], 8)
    _wait_restarted(cluster, "pool-store-0", old, cluster.store_health)


def test_client_disconnect_frees_its_kv(cluster, reference):
    url = cluster.unified_url
    aborted = cluster.metric(url, "kvserve_unified_requests_total", outcome="aborted")
    body = {
        "model": cluster.served_name,
        "prompt": _prompt(reference, 40, 200),
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", cluster.api_base + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        busy = cluster.status(url)
        assert busy["num_running"] == 1 and busy["role"] == "unified"

    def freed() -> bool:
        s = cluster.status(url)
        return s["num_running"] == 0 and s["num_waiting"] == 0

    assert wait_until(freed, timeout_s=10)
    assert cluster.metric(url, "kvserve_unified_requests_total", outcome="aborted") == aborted + 1


def test_a_failing_request_fails_alone(cluster, client, reference):
    """A request whose forward fails (injected) gets a 5xx naming the instance; the
    requests sharing its steps finish with exact tokens."""
    prompts = [_prompt(reference, 60 + i, 120) for i in range(3)]
    want = [text for _, text in _ref_outs(reference, prompts, 16)]
    failed = cluster.metric(cluster.unified_url, "kvserve_unified_requests_total", outcome="failed")

    def poisoned() -> int:
        try:
            client.completions.create(
                model="e2e-model", prompt=prompts[0], max_tokens=16, temperature=0, seed=POISON
            )
        except openai.APIStatusError as e:
            assert "unified instance unified-0" in str(e.message), e.message
            return e.status_code
        return 200

    with cf.ThreadPoolExecutor(4) as pool:
        bad = pool.submit(poisoned)
        good = [pool.submit(_complete, client, ids, 16) for ids in prompts]
        assert bad.result() >= 500
        assert [f.result()[0] for f in good] == want
    after = cluster.metric(cluster.unified_url, "kvserve_unified_requests_total", outcome="failed")
    assert after == failed + 1


def test_bad_input_is_a_400(cluster, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="e2e-model", prompt=[1] * 9000, max_tokens=4)
    r = httpx.post(
        cluster.unified_url + "/generate", content=b"{}", headers=cluster.headers, timeout=10
    )
    assert r.status_code == 400


def test_health_metrics_and_scrape_config_name_the_role(cluster, client, reference):
    _complete(client, _prompt(reference, 50, 20), 2)
    health = httpx.get(cluster.router_url + "/health", timeout=5).json()
    assert health["unified"]["total"] == 1 and health["prefill"]["total"] == 0
    router = httpx.get(cluster.router_url + "/metrics", timeout=5).text
    assert re.search(r'kvserve_router_routed_total\{[^}]*role="unified"[^}]*\} [1-9]', router)
    text = httpx.get(cluster.unified_url + "/metrics", timeout=5).text
    assert 'kvserve_num_requests_running{instance="unified-0",role="unified"}' in text
    assert cluster.metric(cluster.unified_url, "kvserve_generated_tokens_total", role="unified") > 0
    res = kvserve("render", "prometheus", "-c", str(cluster.config))
    assert res.returncode == 0, res.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load(res.stdout)["scrape_configs"]}
    assert jobs["kvserve-unified"]["honor_labels"] is True
    assert jobs["kvserve-unified"]["static_configs"][0]["labels"]["role"] == "unified"


def test_step_trace_shows_each_request_s_path_to_its_first_token(cluster, client, reference):
    """KVSERVE_STEP_TRACE in the instance's env: the worker records each request's arrival,
    admission and first token, the engine every step; the request's prefill steps (chunks of
    at most max_batched_tokens) lie between its arrival and its first token."""
    ids = _prompt(reference, 91, 400)
    _complete(client, ids, 3)
    steps: list[StepRecord] = []
    events: dict[str, dict[str, float]] = {}
    for path in cluster.trace_dir.glob("unified-0-*.jsonl"):
        for line in read_trace(path):
            if isinstance(line, StepRecord):
                steps.append(line)
            elif isinstance(line, RequestEvent):
                events.setdefault(line.rid, {})[line.ev] = line.t
    # the last request that reached its first token is this one (400 prompt tokens)
    rid, ev = max(
        ((r, e) for r, e in events.items() if "first_token" in e), key=lambda x: x[1]["arrival"]
    )
    assert ev["arrival"] <= ev["added"] <= ev["first_token"]
    mine = [(s, r) for s in steps for r in s.rows if r[0] == rid]
    first = next(i for i, (_, r) in enumerate(mine) if r[3])  # the step that sampled first
    prefill = mine[: first + 1]
    assert prefill and all(ev["arrival"] <= s.t0 for s, _ in prefill)
    assert sum(r[1] for _, r in prefill) <= len(ids)  # less when a prefix was cached
    assert prefill[-1][1][2] + prefill[-1][1][1] == len(ids) and prefill[-1][1][3]
    assert all(r[1] <= 256 for _, r in prefill)  # max_batched_tokens
    assert prefill[-1][0].end <= ev["first_token"]

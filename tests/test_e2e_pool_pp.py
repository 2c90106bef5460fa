"""The shared pool with a pipelined prefill, through `kvserve up` and the router: a PP 2
prefill (each stage saves and restores its own layers from its own process) and a
TP 2 x DCP 2 decode. Multi-turn sessions restored after every prefix-cache reset equal a
cold single-process run token for token, every stage saved and restored (per-stage
series), and a load that fails mid-flight on one stage (an injected fault) recomputes
only its own request, from its first missing chunk. A KV connector call that raises in
one process (engine/kv_connector_guard.py: prefill stage 1's loads or saves, decode rank
1's scatter) fails or recomputes only the requests its step metadata named."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import random
import signal
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from cluster_harness import Cluster, free_ports, launch, metric_sum, router_section, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    ErrorEvent,
    FirstToken,
    LandingGrant,
    PrefillRequest,
    TokenBatch,
)
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
CHUNK = 256
MAX_TOKENS = 6
VOCAB = ["agent", "tool", "cache", "token", "block", "router", "decode", "pool", "turn", "stage"]


class PPPoolCluster(Cluster):
    prefill_metrics_url: str = ""
    fault_dir: Path = Path()
    master_metrics_port: int = 0
    store_metrics_ports: tuple[int, ...] = ()

    def prefill_metric(self, name: str, **labels: str) -> float:
        """Sum of the prefill's samples of a series whose labels include `labels`."""
        return metric_sum(self.prefill_metrics_url, name, **labels)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_parallel_dir: Path, weights_cache_dir: str):
    tmp = tmp_path_factory.mktemp("pp-pool")
    faults = tmp / "faults"
    faults.mkdir()
    (faults / "decode").mkdir()  # engine/kv_connector_guard.py faults of decode's ranks
    p = free_ports(8)
    cfg = {
        "name": "pp-pool",
        "model": str(tiny_parallel_dir),
        "dtype": "float32",
        "cache": {"block_size": 16, "chunk_size": CHUNK, "weights_cache_dir": weights_cache_dir},
        "nodes": [{"name": "local", "host": "127.0.0.1"}],
        "pool": {
            "master": {"node": "local", "port": p[1], "metrics_port": p[2], "client_ttl_s": 3},
            "stores": [
                {"node": "local", "numa_node": i, "size": "16MiB", "metrics_port": p[3 + i]}
                for i in range(2)
            ],
        },
        "prefill": [
            {
                "name": "prefill-0",
                "node": "local",
                "port": p[5],
                "devices": ["cpu", "cpu"],
                "pipeline_parallel": 2,
                "max_batched_tokens": 256,
                "max_num_seqs": 16,
                "kv_cache_memory": "16MiB",
                "pool_buffer_memory": "8MiB",
                "env": {"KVSERVE_POOL_FAULT_DIR": str(faults), "KVSERVE_KV_FAULT_DIR": str(faults)},
            }
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "local",
                "port": p[6],
                "devices": ["cpu", "cpu"],
                "tensor_parallel": 2,
                "decode_context_parallel": 2,
                "max_num_seqs": 16,
                "kv_cache_memory": "16MiB",
                "landing_memory": "8MiB",
                "env": {"KVSERVE_KV_FAULT_DIR": str(faults / "decode")},
            }
        ],
        "router": router_section(p[0], "pp-pool-model", timeout_s=120),
    }
    config, state = launch(tmp, cfg, timeout=600)
    c = PPPoolCluster(config, state, f"http://127.0.0.1:{p[0]}", "", "", "pp-pool-model", "pp-pool")
    c.prefill_metrics_url = f"http://127.0.0.1:{p[5]}"
    c.prefill_url, c.decode_url = c.prefill_metrics_url, f"http://127.0.0.1:{p[6]}"
    c.fault_dir = faults
    c.master_metrics_port = p[2]
    c.store_metrics_ports = (p[3], p[4])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_parallel_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_parallel_dir), EngineConfig(cache_dir=weights_cache_dir))


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n))


class Session:
    """A growing prompt: each turn is the last prompt + its completion + new text."""

    def __init__(self, seed: int, ref: LLMEngine, words: int) -> None:
        self.seed, self.ref = seed, ref
        self.text = _words(seed, words)

    def turn(self, c: Cluster, k: int) -> tuple[dict, list[int]]:
        """Send turn k (its output must equal a cold run); returns (usage details, ids)."""
        return self.send(c, *self.prepare(k))

    def prepare(self, k: int) -> tuple[int, list[int], str]:
        """Turn k's prompt and the cold run's output for it (the reference engine is not
        thread-safe: prepare turns one at a time, send them at once)."""
        if k:
            self.text += " " + _words(self.seed * 100 + k, 60)
        ids = self.ref.info.tokenizer.encode(self.text)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return k, ids, self.ref.generate([ids], params)[0].text

    def send(self, c: Cluster, k: int, ids: list[int], want: str) -> tuple[dict, list[int]]:
        client = openai.OpenAI(base_url=c.api_base, api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(
            model=c.served_name,
            prompt=self.text,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want, f"turn {k}: output differs from a cold run"
        details = got.usage.prompt_tokens_details.model_dump()
        assert details["gpu_tokens"] + details["pool_tokens"] + details["computed_tokens"] == len(
            ids
        )
        self.text += got.choices[0].text
        return details, ids


def test_multi_turn_restore_from_every_stage_equals_cold(cluster: PPPoolCluster, reference):
    s = Session(1, reference, 200)
    prev_len = 0
    restored = 0
    for k in range(3):
        cluster.reset()  # the GPU prefix cache is gone; the pool keeps every stage's objects
        details, ids = s.turn(cluster, k)
        assert details["gpu_tokens"] == 0
        if k == 0:
            assert details["pool_tokens"] == 0
        else:
            want = min(prev_len // CHUNK, (len(ids) - 1) // CHUNK) * CHUNK
            assert want > 0 and details["pool_tokens"] == want, (k, details, prev_len)
        restored += details["pool_tokens"]
        prev_len = len(ids)
    assert restored > 0
    # Each stage stored and restored its own objects, from its own process.
    for stage in ("0", "1"):

        def both(stage: str = stage) -> bool:
            m = cluster.prefill_metric
            return (
                m("kvserve_pool_stage_objects_total", stage=stage, op="save") > 0
                and m("kvserve_pool_stage_objects_total", stage=stage, op="load") * CHUNK
                >= restored
            )

        assert wait_until(both, timeout_s=10, interval_s=0.2), f"stage {stage} saved/restored"
        assert cluster.prefill_metric("kvserve_pool_restore_seconds_count", stage=stage) >= 2
    assert cluster.prefill_metric("kvserve_pool_restored_tokens_total") >= restored
    assert cluster.prefill_metric("kvserve_prompt_tokens_total", source="pool") >= restored
    assert cluster.prefill_metric("kvserve_pool_save_chunks_total") >= 2


def test_load_failed_on_one_stage_recomputes_only_that_request(cluster: PPPoolCluster, reference):
    sessions = [Session(20 + i, reference, 220) for i in range(2)]
    lens = []
    for s in sessions:
        _, ids = s.turn(cluster, 0)  # both histories saved (>= 2 chunks each)
        lens.append(len(ids))
    assert min(lens) >= 2 * CHUNK
    # Every chunk of both histories is in the pool before the fault is armed.
    assert wait_until(
        lambda: (
            cluster.prefill_metric("kvserve_pool_save_chunks_total")
            >= sum(n // CHUNK for n in lens)
        ),
        timeout_s=10,
        interval_s=0.2,
    )
    cluster.reset()
    before = cluster.prefill_metric("kvserve_pool_failures_total", op="load", reason="injected")
    (cluster.fault_dir / "load-stage1").touch()  # stage 1's next read returns one object
    turns = [s.prepare(1) for s in sessions]
    with cf.ThreadPoolExecutor(2) as ex:
        results = list(
            ex.map(lambda st: st[0].send(cluster, *st[1]), zip(sessions, turns, strict=True))
        )
    assert not (cluster.fault_dir / "load-stage1").exists(), "the fault was never taken"
    got = [
        (d["pool_tokens"], min(n // CHUNK, (len(ids) - 1) // CHUNK) * CHUNK)
        for n, (d, ids) in zip(lens, results, strict=True)
    ]
    # One request restored only its first chunk (stage 1 lost the rest) and recomputed
    # from there; the other restored everything; both outputs equal a cold run (turn()).
    short = [g for g in got if g[0] < g[1]]
    assert len(short) == 1 and short[0][0] == CHUNK, got
    assert all(pool == full for pool, full in got if (pool, full) != short[0]), got
    assert (
        cluster.prefill_metric("kvserve_pool_failures_total", op="load", reason="injected") > before
    )


def _status(c: PPPoolCluster, url: str) -> dict:
    return httpx.get(url + "/status", headers=c.headers, timeout=10).json()


def _no_kv_held(c: PPPoolCluster) -> bool:
    return all(
        s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0
        for s in (_status(c, c.prefill_url), _status(c, c.decode_url))
    )


def test_pool_loads_call_failed_on_one_stage_recompute(cluster: PPPoolCluster, reference):
    """Stage 1's start_loads raises: the step's loads count as restoring nothing there,
    the requests recompute without the pool (exact), nothing fails, the pool serves on."""
    sessions = [Session(40 + i, reference, 220) for i in range(2)]
    lens = [len(s.turn(cluster, 0)[1]) for s in sessions]
    assert wait_until(
        lambda: (
            cluster.prefill_metric("kvserve_pool_save_chunks_total")
            >= sum(n // CHUNK for n in lens)
        ),
        timeout_s=10,
        interval_s=0.2,
    )
    cluster.reset()
    (cluster.fault_dir / "start_loads-p1").touch()
    turns = [s.prepare(1) for s in sessions]
    with cf.ThreadPoolExecutor(2) as ex:  # each output is checked against a cold run
        results = list(
            ex.map(lambda st: st[0].send(cluster, *st[1]), zip(sessions, turns, strict=True))
        )
    assert not (cluster.fault_dir / "start_loads-p1").exists(), "the fault was never taken"
    pool = [d["pool_tokens"] for d, _ in results]
    assert min(pool) == 0, pool  # the failed call's request(s) restored nothing
    cluster.reset()  # and the pool serves on: the next turn restores again
    details, _ = sessions[0].turn(cluster, 2)
    assert details["pool_tokens"] >= CHUNK
    assert wait_until(lambda: _no_kv_held(cluster), 20)


def _fresh(seed: int, n: int) -> str:
    return f"{seed} " + _words(seed, n)


def _complete(c: PPPoolCluster, prompt: str) -> httpx.Response:
    body = {
        "model": c.served_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(c.router_url + "/v1/completions", json=body, timeout=120)


def test_handoff_sends_call_failed_on_one_stage_fail_alone(cluster: PPPoolCluster, reference):
    """Stage 1's start_saves raises for the first step of three new requests whose
    landings prefill already holds: those its metadata named (opens and sends: decode
    would miss stage 1's layers) fail with a clear error, the others are exact, every
    flow closes (no KV held), and the next requests are exact. The workers are called as
    the router calls them, with each grant sent before its request (kept by prefill), so
    that the handoff opens in the very step the fault hits (through the router the grant
    may come a step later than the first compute, whose metadata then holds only the
    pool's saves)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [_fresh(300 + i, 40 + 30 * i) for i in range(3)]
    tok = reference.info.tokenizer
    ids = [tok.encode(p) for p in prompts]
    want = [c.token_ids for c in reference.generate(ids, params)]
    assert wait_until(lambda: _no_kv_held(cluster), 20)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(headers=cluster.headers, timeout=120))
        decodes = []
        for i, prompt in enumerate(ids):
            req = DecodeRequest(PROTOCOL_VERSION, f"saves-{i}", prompt, params)
            stream = stack.enter_context(
                client.stream(
                    "POST", cluster.decode_url + "/decode", content=msgspec.json.encode(req)
                )
            )
            lines = (line for line in stream.iter_lines() if line)
            ready = msgspec.json.decode(next(lines), type=DecodeReady)
            grant = LandingGrant(
                PROTOCOL_VERSION, ready.request_id, ready.landing, ready.notify_url
            )
            r = client.post(cluster.prefill_url + "/landing", content=msgspec.json.encode(grant))
            assert r.status_code == 200 and r.json()["outcome"] == "early", r.text
            decodes.append(lines)
        (cluster.fault_dir / "start_saves-p1").touch()

        def prefill(i: int) -> FirstToken | ErrorEvent:
            req = PrefillRequest(PROTOCOL_VERSION, f"saves-{i}", ids[i], params, [], "", True)
            r = client.post(cluster.prefill_url + "/prefill", content=msgspec.json.encode(req))
            assert r.status_code == 200, r.text
            return msgspec.json.decode(r.content.splitlines()[0], type=FirstToken | ErrorEvent)

        with cf.ThreadPoolExecutor(3) as ex:
            firsts = list(ex.map(prefill, range(3)))
        assert not (cluster.fault_dir / "start_saves-p1").exists(), "the fault was never taken"
        failed = [i for i, f in enumerate(firsts) if isinstance(f, ErrorEvent)]
        assert failed, "no request was named by the failed call"
        for i, first in enumerate(firsts):
            if isinstance(first, ErrorEvent):
                assert first.status == 500, first
                assert "KV connector's start_saves failed in process 1" in first.message
                abort = AbortRequest(f"saves-{i}", "error", prefill_contacted=True)
                client.post(cluster.decode_url + "/abort", content=msgspec.json.encode(abort))
                continue
            tokens = [first.token_id]
            for line in decodes[i]:
                tokens += msgspec.json.decode(line, type=TokenBatch).token_ids
            assert tokens == want[i]
    assert wait_until(lambda: _no_kv_held(cluster), 30), "a flow of a failed request stayed open"
    for p, w in zip(prompts, want, strict=True):
        r = _complete(cluster, p)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(w), r.text


def test_decode_scatter_call_failed_on_one_rank_recomputes(cluster: PPPoolCluster, reference):
    """Decode rank 1's start_loads (the scatter of landed KV) raises: the step's pieces
    count as failed on every rank, their requests recompute at decode from what every
    rank holds, and every output is exact; decode serves on and holds nothing after."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [_fresh(400 + i, 60 + 40 * i) for i in range(3)]
    tok = reference.info.tokenizer
    want = [c.text for c in reference.generate([tok.encode(p) for p in prompts], params)]
    fault = cluster.fault_dir / "decode" / "start_loads-p1"
    fault.touch()
    with cf.ThreadPoolExecutor(3) as ex:
        answers = list(ex.map(lambda p: _complete(cluster, p), prompts))
    assert not fault.exists(), "the fault was never taken"
    for r, w in zip(answers, want, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == w
    assert wait_until(lambda: _no_kv_held(cluster), 20)


def _kill_and_wait(c: PPPoolCluster, name: str, health: str) -> None:
    old = c.pids()[name]
    os.kill(old, signal.SIGKILL)

    def back() -> bool:
        try:
            return c.pids()[name] != old and httpx.get(health, timeout=1).status_code == 200
        except (httpx.HTTPError, KeyError, OSError):
            return False

    assert wait_until(back, timeout_s=40, interval_s=0.2), f"{name} did not come back"


@pytest.mark.slow
def test_store_and_master_killed_every_stage_recomputes_then_pools_again(
    cluster: PPPoolCluster, reference
):
    """SIGKILL a store, then the master, under a PP 2 prefill: every turn succeeds with the
    cold run's output; once they are back both stages save and restore again (each stage
    process's breaker closed on its own)."""
    sessions = [Session(40 + i, reference, 200) for i in range(3)]
    for s in sessions:
        s.turn(cluster, 0)
    cluster.reset()
    store0 = f"http://127.0.0.1:{cluster.store_metrics_ports[0]}/health"
    master = f"http://127.0.0.1:{cluster.master_metrics_port}/health"
    os.kill(cluster.pids()["pool-store-0"], signal.SIGKILL)
    for s in sessions:  # objects on the dead store fail to load: recomputed, same output
        s.turn(cluster, 1)
    assert wait_until(
        lambda: httpx.get(store0, timeout=1).status_code == 200, timeout_s=40, interval_s=0.2
    )
    _kill_and_wait(cluster, "pool-master", master)
    cluster.reset()
    for s in sessions:
        s.turn(cluster, 2)  # lookups may fail: computed, same output
    before = {
        st: cluster.prefill_metric("kvserve_pool_stage_objects_total", stage=st, op="load")
        for st in ("0", "1")
    }
    deadline = time.monotonic() + 60
    while True:  # pooling resumes once the stores remounted and the breakers closed
        s = Session(int(time.monotonic() * 1000) % 10_000 + 100, reference, 200)
        s.turn(cluster, 0)
        cluster.reset()
        details, _ = s.turn(cluster, 1)
        if details["pool_tokens"] > 0:
            break
        assert time.monotonic() < deadline, "pooling did not resume"
        time.sleep(1)
    for st in ("0", "1"):
        assert (
            cluster.prefill_metric("kvserve_pool_stage_objects_total", stage=st, op="load")
            > before[st]
        )

"""End to end with the pool: `kvserve up` starts a Mooncake master and two store services
(tcp on loopback), two prefill instances, a decode instance and the router, on a tiny
random Llama. A multi-turn session restores its history from the pool after every GPU
prefix-cache reset and matches a cold recompute; a turn on the instance that never saw
the session restores it; the pool processes advertise and bind the node's address;
killing a store and then the master never fails a request, shows in the metrics, and
pooling resumes once the launcher has restarted them. A second cluster on two loopback
"nodes" (127.0.0.1, 127.0.0.2) with `pool.shared: false` cannot share history."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from cluster_harness import Cluster, free_ports, kvserve, launch, router_section, wait_until
from pool_harness import listening_sockets

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
CHUNK = 256
POOL_SERIES = (
    "kvserve_pool_lookups_total",
    "kvserve_pool_hit_chunks_total",
    "kvserve_pool_miss_chunks_total",
    "kvserve_pool_load_bytes_total",
    "kvserve_pool_save_bytes_total",
    "kvserve_pool_restore_seconds",
    "kvserve_pool_restore_wait_seconds",
    "kvserve_pool_save_queue_depth",
    "kvserve_pool_save_dropped_total",
    "kvserve_pool_failures_total",
    "kvserve_pool_checksum_failures_total",
)


def _cluster_config(model: str, cache_dir: str, *, shared: bool, name: str) -> dict:
    """Two prefill instances; shared: one node, one master, two stores (two NUMA nodes);
    split: nodes a (127.0.0.1) and b (127.0.0.2), a master and a store on each."""
    p = free_ports(12)
    hosts = ["127.0.0.1"] if shared else ["127.0.0.1", "127.0.0.2"]
    nodes = [{"name": f"n{i}", "host": h} for i, h in enumerate(hosts)]
    last = nodes[-1]["name"]
    stores = [
        {"node": "n0", "numa_node": 0, "size": "24MiB", "metrics_port": p[3]},
        {"node": last, "numa_node": 1 if shared else 0, "size": "24MiB", "metrics_port": p[4]},
    ]
    prefill = {
        "devices": ["cpu"],
        "max_batched_tokens": 512,
        "max_num_seqs": 16,
        "kv_cache_memory": "32MiB",
        "pool_buffer_memory": "8MiB",
    }
    cfg = {
        "name": name,
        "model": model,
        "dtype": "float32",
        "cache": {"block_size": 16, "chunk_size": CHUNK, "weights_cache_dir": cache_dir},
        "nodes": nodes,
        "pool": {
            "shared": shared,
            "master": {"node": "n0", "port": p[1], "metrics_port": p[2], "client_ttl_s": 3},
            "stores": stores,
        },
        "prefill": [
            {"name": "prefill-0", "node": "n0", "port": p[5], **prefill},
            {"name": "prefill-1", "node": last, "port": p[6], **prefill},
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "n0",
                "port": p[7],
                "devices": ["cpu"],
                "kv_cache_memory": "32MiB",
                "landing_memory": "16MiB",
            }
        ],
        "router": router_section(p[0], "e2e-model"),
    }
    return cfg


class PoolCluster(Cluster):
    cfg: dict

    def prefill_urls(self) -> list[str]:
        nodes = {n["name"]: n["host"] for n in self.cfg["nodes"]}
        return [f"http://{nodes[p['node']]}:{p['port']}" for p in self.cfg["prefill"]]

    def pool_tokens(self) -> list[float]:
        return [
            self.metric(u, "kvserve_prompt_tokens_total", source="pool")
            for u in self.prefill_urls()
        ]


def _start(tmp: Path, model: str, cache_dir: str, *, shared: bool, name: str) -> PoolCluster:
    cfg = _cluster_config(model, cache_dir, shared=shared, name=name)
    path, state = launch(tmp, cfg)
    c = PoolCluster(
        path,
        state,
        f"http://127.0.0.1:{cfg['router']['port']}",
        "",
        "",
        "e2e-model",
        name,
        f"http://127.0.0.1:{cfg['pool']['master']['metrics_port']}",
    )
    c.cfg = cfg
    return c


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str):
    c = _start(
        tmp_path_factory.mktemp("shared"),
        str(tiny_llama_dir),
        weights_cache_dir,
        shared=True,
        name="e2e-pool",
    )
    yield c
    c.stop()


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.api_base, api_key="unused", max_retries=0, timeout=60)


class Session:
    """A growing prompt: each turn is the last prompt + its completion + new text."""

    def __init__(self, seed: int, ref: LLMEngine) -> None:
        self.seed = seed
        self.ref = ref
        self.text = self._words(seed, 120)

    @staticmethod
    def _words(seed: int, n: int) -> str:
        import random

        rng = random.Random(seed)
        vocab = ["agent", "tool", "cache", "token", "block", "router", "decode", "pool", "turn"]
        return " ".join(rng.choice(vocab) for _ in range(n))

    def turn(self, c: Cluster, k: int) -> tuple[str, dict, list[int]]:
        """Send turn k; returns (completion, usage details, prompt ids)."""
        if k:
            self.text += " " + self._words(self.seed * 100 + k, 40)
        ids = self.ref.info.tokenizer.encode(self.text)
        want = self.ref.generate(
            [ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )[0]
        got = _client(c).completions.create(
            model=c.served_name,
            prompt=self.text,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.text, f"turn {k}: output differs from a cold run"
        assert got.usage.prompt_tokens == len(ids)
        details = got.usage.prompt_tokens_details.model_dump()
        assert details["gpu_tokens"] + details["pool_tokens"] + details["computed_tokens"] == len(
            ids
        )
        assert details["cached_tokens"] == details["gpu_tokens"] + details["pool_tokens"]
        self.text += got.choices[0].text
        return got.choices[0].text, details, ids


def test_pool_processes_start_first_and_stay_on_the_node_address(shared: PoolCluster):
    pids = shared.pids()
    assert list(pids)[:3] == ["pool-master", "pool-store-0", "pool-store-1"]
    for name in ("pool-master", "pool-store-0", "pool-store-1", "prefill-0", "prefill-1"):
        env = Path(f"/proc/{pids[name]}/environ").read_bytes().split(b"\0")
        assert b"MC_TCP_BIND_ADDRESS=127.0.0.1" in env, name
    socks = listening_sockets(pids["pool-master"])
    assert socks and {a for a, _ in socks} == {"127.0.0.1"}, socks
    text = httpx.get(shared.pool_metrics_url + "/metrics", timeout=5).text  # type: ignore[operator]
    assert re.search(rf"^master_total_capacity_bytes {48 << 20}$", text, re.M)
    health = httpx.get(f"http://127.0.0.1:{shared.cfg['pool']['stores'][0]['metrics_port']}/health")
    assert health.status_code == 200 and health.json()["master_reachable"]
    res = kvserve("status", "-c", str(shared.config), "--state-dir", str(shared.state_dir))
    assert res.returncode == 0 and "pool-store-1" in res.stdout, res.stdout


def test_multi_turn_session_restores_history_after_every_reset(shared: PoolCluster, reference):
    s = Session(1, reference)
    before = sum(shared.pool_tokens())
    restored = 0
    prev_len = 0
    for k in range(4):
        shared.reset()  # drops both instances' GPU prefix caches; the pool keeps its contents
        _, details, ids = s.turn(shared, k)
        assert details["gpu_tokens"] == 0
        if k == 0:
            assert details["pool_tokens"] == 0
        else:
            # Every full chunk of the previous prompt (saved by whichever instance ran it)
            want = min(prev_len // CHUNK, (len(ids) - 1) // CHUNK) * CHUNK
            assert want > 0 and details["pool_tokens"] == want, (k, details, prev_len)
            assert details["computed_tokens"] == len(ids) - want
        restored += details["pool_tokens"]
        prev_len = len(ids)
    assert sum(shared.pool_tokens()) - before == restored


def test_turn_on_the_instance_that_never_saw_the_session(shared: PoolCluster, reference):
    s = Session(2, reference)
    first = shared.pool_tokens()
    s.turn(shared, 0)  # round robin: one instance computes and saves it
    mid = shared.pool_tokens()
    _, details, _ = s.turn(shared, 1)  # ... the other one gets the next turn
    after = shared.pool_tokens()
    assert details["gpu_tokens"] == 0 and details["pool_tokens"] > 0
    gained = [a - m for a, m in zip(after, mid, strict=True)]
    assert sorted(g > 0 for g in gained) == [False, True] and first == mid


def test_metrics_and_reset_keep_the_pool(shared: PoolCluster, reference):
    for url in shared.prefill_urls():
        text = httpx.get(url + "/metrics", timeout=10).text
        for name in POOL_SERIES:
            assert name in text, f"{name} missing on {url}"
    prompt = Session._words(3, 300)
    n = len(reference.info.tokenizer.encode(prompt))
    assert n > 2 * CHUNK

    def send() -> dict:
        got = _client(shared).completions.create(
            model=shared.served_name, prompt=prompt, max_tokens=2, temperature=0
        )
        return got.usage.prompt_tokens_details.model_dump()

    send()
    r = httpx.post(shared.router_url + "/v1/admin/reset_prefix_cache", timeout=30)
    assert r.status_code == 200
    assert all(v["status"] == 200 for v in r.json()["instances"].values())
    # The same prompt right after the reset: from the pool, not the GPU (either instance).
    details = send()
    assert details["gpu_tokens"] == 0 and details["pool_tokens"] == (n - 1) // CHUNK * CHUNK


def _kill(c: PoolCluster, name: str) -> int:
    pid = c.pids()[name]
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_restarted(c: PoolCluster, name: str, old_pid: int, health: str) -> None:
    def back() -> bool:
        try:
            return c.pids()[name] != old_pid and httpx.get(health, timeout=1).status_code == 200
        except (httpx.HTTPError, KeyError, OSError):
            return False

    assert wait_until(back, timeout_s=30, interval_s=0.2), f"{name} did not come back"


def _failures(c: PoolCluster, **labels: str) -> float:
    return sum(c.metric(u, "kvserve_pool_failures_total", **labels) for u in c.prefill_urls())


def _failure_reasons(c: PoolCluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for u in c.prefill_urls():
        text = httpx.get(u + "/metrics", timeout=10).text
        for m in re.finditer(r"^kvserve_pool_failures_total\{([^}]*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = f"{labels['op']}/{labels['reason']}"
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def test_faults_store_then_master_every_request_succeeds(shared: PoolCluster, reference):
    sessions = [Session(10 + i, reference) for i in range(3)]
    chunk = shared.cfg["cache"]["chunk_size"]
    first = [s.turn(shared, 0)[2] for s in sessions]  # history saved across both stores
    shared.reset()
    fails = _failures(shared)
    store0 = shared.cfg["pool"]["stores"][0]["metrics_port"]
    old = _kill(shared, "pool-store-0")
    restored, saved = [], []
    for s, ids0 in zip(sessions, first, strict=True):  # the dead store's objects: recomputed
        _, details, ids1 = s.turn(shared, 1)
        restored.append(details["pool_tokens"])
        common = next(
            (i for i, (a, b) in enumerate(zip(ids0, ids1, strict=False)) if a != b), len(ids0)
        )
        saved.append(min(common, len(ids1) - 1) // chunk * chunk)  # restorable whole chunks
    reasons = _failure_reasons(shared)
    # Either a read of the dead store failed (counted), or the master had already dropped
    # its objects and the lookup missed them (a shorter restore): both leave a trace.
    missed = any(r < h for r, h in zip(restored, saved, strict=True))
    assert _failures(shared) > fails or missed, (
        f"the dead store left no trace: failures {reasons}, restored {restored} of {saved}"
    )
    print("after the store kill:", reasons)
    _wait_restarted(shared, "pool-store-0", old, f"http://127.0.0.1:{store0}/health")

    old = _kill(shared, "pool-master")
    fails = _failures(shared)
    shared.reset()
    for s in sessions:  # the master is gone: lookups fail, everything is computed
        _, details, _ = s.turn(shared, 2)
        assert details["pool_tokens"] == 0
    reasons = _failure_reasons(shared)
    print("after the master kill:", reasons)
    assert _failures(shared, op="lookup") > 0, reasons
    _wait_restarted(shared, "pool-master", old, shared.pool_metrics_url + "/health")  # type: ignore[operator]

    def capacity_back() -> bool:
        text = httpx.get(shared.pool_metrics_url + "/metrics", timeout=2).text  # type: ignore[operator]
        return bool(re.search(rf"^master_total_capacity_bytes {48 << 20}$", text, re.M))

    assert wait_until(capacity_back, timeout_s=30, interval_s=0.2), "stores did not remount"
    # Pooling resumes: a new session is saved, then restored after a reset (the prefill
    # clients' breakers close on their next probe, within a few seconds).
    s = Session(99, reference)
    deadline = time.monotonic() + 40
    while True:
        s.turn(shared, 0)
        shared.reset()
        _, details, _ = s.turn(shared, 1)
        if details["pool_tokens"] > 0:
            break
        assert time.monotonic() < deadline, "pooling did not resume"
        s = Session(int(time.monotonic() * 1000) % 10_000 + 100, reference)
        time.sleep(1)


def test_split_pools_do_not_share(tmp_path_factory, tiny_llama_dir, weights_cache_dir, reference):
    c = _start(
        tmp_path_factory.mktemp("split"),
        str(tiny_llama_dir),
        weights_cache_dir,
        shared=False,
        name="e2e-split",
    )
    try:
        pids = c.pids()
        assert {"pool-master-n0", "pool-master-n1"} <= set(pids)
        env = Path(f"/proc/{pids['prefill-1']}/environ").read_bytes().split(b"\0")
        assert b"MC_TCP_BIND_ADDRESS=127.0.0.2" in env
        s = Session(5, reference)
        s.turn(c, 0)  # prefill-0 (node n0): saved into n0's pool
        _, details, _ = s.turn(c, 1)  # prefill-1 (node n1): its own pool has nothing
        assert details["pool_tokens"] == 0 and details["gpu_tokens"] == 0
        c.reset()
        _, details, _ = s.turn(c, 2)  # prefill-0 again: n0's pool has turn 0's chunks
        assert details["pool_tokens"] > 0
    finally:
        c.stop()

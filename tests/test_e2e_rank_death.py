"""End to end: a rank or stage process of a parallel instance is SIGKILLed (engine/parallel/
procs.py). Real cluster (`kvserve up`, tiny model on CPU, gloo): a TP 2 decode and a PP 2
prefill behind the router.

- rank 1 of the decode dies while requests are generating there: each request fails
  within seconds with a 503 naming the lost process (no hang until a gloo timeout),
  the instance's /health says 503 or refuses, the router marks it unhealthy, the
  supervisor restarts it (a new incarnation) and it serves token-exact again;
- stage 1 of the prefill dies while idle: the same, without a request in flight."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from cluster_harness import wait_until
from parallel_harness import ParallelCluster, start_parallel_cluster

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.incarnation import HEADER as INCARNATION_HEADER
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

DETECT_S = 5.0
"""Bound on kill → every in-flight request answered (watch interval + grace + slack on a
loaded 2-core machine); gloo's own timeout is 30 minutes."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_parallel_dir: Path, weights_cache_dir: str):
    c = start_parallel_cluster(
        tmp_path_factory.mktemp("rank-death"),
        str(tiny_parallel_dir),
        cache_dir=weights_cache_dir,
        prefill={"pp2": {"pipeline_parallel": 2}},
        decode={"tp2": {"tensor_parallel": 2}},
    )
    yield c
    c.down()


@pytest.fixture(scope="module")
def reference(tiny_parallel_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_parallel_dir), EngineConfig(cache_dir=weights_cache_dir))


def _driver_pid(c: ParallelCluster, name: str) -> int:
    state = json.loads((c.state_dir / "parallel" / "state.json").read_text())
    return next(int(s["pid"]) for s in state["components"] if s["name"] == name)


def _child_pid(driver: int) -> int:
    """The driver's one rank / stage process (python -m decode_worker.ranks / stages)."""
    kids = [p for p in psutil.Process(driver).children() if "python" in p.name().lower()]
    assert len(kids) == 1, kids
    return kids[0].pid


def _router_instance(c: ParallelCluster, name: str) -> dict:
    body = httpx.get(c.router_url + "/health", timeout=5).json()
    for role in body["instances"].values() if "instances" in body else body.values():
        if isinstance(role, dict):
            for inst in role.get("instances", []):
                if inst["name"] == name:
                    return inst
    raise AssertionError(f"{name} not in the router's /health: {body}")


def _incarnation(c: ParallelCluster, name: str) -> str | None:
    try:
        r = httpx.get(c.urls[name] + "/health", timeout=2)
    except httpx.HTTPError:
        return None
    return r.headers.get(INCARNATION_HEADER) if r.status_code == 200 else None


def _complete(c: ParallelCluster, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {
        "model": c.served_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(c.router_url + "/v1/completions", json=body, timeout=120)


def _restarted_and_exact(c: ParallelCluster, name: str, old: str, reference: LLMEngine) -> None:
    assert wait_until(lambda: _incarnation(c, name) not in (None, old), 120), (
        f"{name} was not restarted"
    )
    assert wait_until(lambda: _router_instance(c, name)["healthy"], 30)
    prompts = [[11 + i, 40, 77, 5 * i + 3, 99, 120, 18] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [x.text for x in reference.generate(prompts, params)]
    for p, w in zip(prompts, want, strict=True):
        r = _complete(c, p, 8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == w


def test_decode_rank_killed_mid_generation(cluster: ParallelCluster, reference: LLMEngine):
    c = cluster
    driver = _driver_pid(c, "tp2")
    rank1 = _child_pid(driver)
    old = _incarnation(c, "tp2")
    assert old
    headers = c.headers
    with cf.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_complete, c, [7 + i, 8, 9, 10], 3000) for i in range(3)]
        assert wait_until(
            lambda: (
                httpx.get(c.urls["tp2"] + "/status", headers=headers, timeout=5).json()[
                    "num_running"
                ]
                == 3
            ),
            60,
        ), "the requests never ran at decode"
        time.sleep(0.3)  # a few decode steps
        assert not any(f.done() for f in futures)
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        answers = [f.result(timeout=60) for f in futures]
        took = time.monotonic() - killed
    for r in answers:
        assert r.status_code == 503, r.text
        assert "lost a process" in r.text and "decode rank 1" in r.text, r.text
    assert took < DETECT_S, f"in-flight requests answered {took:.1f}s after the kill"
    # the driver exits (the supervisor restarts the instance): the router stops routing
    assert wait_until(lambda: not psutil.pid_exists(driver) or _is_zombie(driver), 10)
    _restarted_and_exact(c, "tp2", old, reference)


@pytest.mark.slow  # CI time: the decode case above runs the same machinery
def test_prefill_stage_killed(cluster: ParallelCluster, reference: LLMEngine):
    c = cluster
    driver = _driver_pid(c, "pp2")
    stage1 = _child_pid(driver)
    old = _incarnation(c, "pp2")
    assert old
    killed = time.monotonic()
    os.kill(stage1, signal.SIGKILL)
    # noticed within the bound: /health 503 (naming the stage) or the driver gone
    seen: list[str] = []

    def noticed() -> bool:
        try:
            r = httpx.get(c.urls["pp2"] + "/health", timeout=2)
        except httpx.HTTPError:
            return True
        if r.status_code == 503:
            seen.append(r.text)
            return True
        return False

    assert wait_until(noticed, DETECT_S, 0.05)
    assert time.monotonic() - killed < DETECT_S
    if seen:
        assert "prefill stage 1" in seen[0], seen
    # the router stops routing to it: a request meanwhile gets a clear 503, not a hang
    assert wait_until(lambda: not _router_instance(c, "pp2")["healthy"], 10)
    if _incarnation(c, "pp2") is None:  # still down
        r = _complete(c, [1, 2, 3], 4)
        assert r.status_code == 503, r.text
    _restarted_and_exact(c, "pp2", old, reference)


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

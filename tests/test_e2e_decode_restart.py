"""A decode worker is killed and restarted while prefill still holds a request aimed at
it (real cluster: Mooncake Transfer Engine, worker processes, router, tiny model).

The held request's handoff then fails against the dead process, and the router reads its
broken decode stream only after that, when the restarted decode already serves. Requests
sent right after must be served by the new process, token-exact, with no 503: the router
tells the old process's broken stream from a failure of the new one (incarnations,
protocol/incarnation.py)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from cluster_harness import (
    Cluster,
    complete_ids,
    greedy_text,
    router_decode,
    spread_prompt,
    start_cluster,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

HELD = 77
"""Prompt tokens of the request whose KV writes are held until decode was restarted."""


def _decode_incarnation(c: Cluster) -> str:
    try:
        r = httpx.get(c.decode_url + "/health", timeout=2, trust_env=False)
    except httpx.HTTPError:
        return ""
    return r.headers.get("kvserve-incarnation", "") if r.status_code == 200 else ""


def test_requests_right_after_a_decode_restart_are_served_exactly(
    tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir: str
) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    ref = LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))
    release = tmp_path / "release"
    c = start_cluster(
        tmp_path,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        prefill={"handoff_faults": {"hold_prompt_tokens": HELD, "hold_until_file": str(release)}},
    )
    prompts = [spread_prompt(40 + 3 * i, i) for i in range(6)]
    want = [greedy_text(ref, p) for p in prompts]
    try:
        before = complete_ids(c, prompts[0])
        assert before["status"] == 200, before
        assert before["body"]["choices"][0]["text"] == want[0]
        old_incarnation = _decode_incarnation(c)
        assert old_incarnation

        held: dict = {}
        t = threading.Thread(target=lambda: held.update(complete_ids(c, spread_prompt(HELD, 99))))
        t.start()
        assert wait_until(lambda: Path(str(release) + ".held").exists(), timeout_s=60)

        old_pid = c.pids()["decode-0"]
        os.kill(old_pid, signal.SIGKILL)
        # Restarted, and the router has polled the new process.
        assert wait_until(
            lambda: _decode_incarnation(c) not in ("", old_incarnation), timeout_s=180
        )
        new_incarnation = _decode_incarnation(c)
        assert wait_until(
            lambda: (
                router_decode(c)["incarnation"] == new_incarnation and router_decode(c)["healthy"]
            ),
            timeout_s=30,
        )
        assert c.pids()["decode-0"] != old_pid

        release.touch()  # the held handoff now writes to the dead process, and fails
        t.join(timeout=120)
        assert not t.is_alive()
        assert held["status"] >= 500, held  # its decode died: it fails, with a message
        assert held["body"]["error"]["message"]

        started = time.monotonic()
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: complete_ids(c, p), prompts))
        for res, text in zip(results, want, strict=True):
            assert res["status"] == 200, res  # no 503 "no healthy decode instance"
            assert res["body"]["choices"][0]["text"] == text
        assert time.monotonic() - started < 60
        assert router_decode(c)["healthy"]
    finally:
        res = c.down()
    assert res.returncode == 0, res.stderr

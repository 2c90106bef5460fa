"""A decode worker dies while requests reserved on it still wait at prefill (real
cluster: Mooncake Transfer Engine, worker processes, router, tiny model).

The router learns decode is down (its /health poll is refused, or a new process
answers) and fails those requests at once with a 503 naming the decode instance
(router/decode_bindings.py), without waiting for prefill: it aborts them at prefill,
which then computes nothing for them, even those still held at its door. Requests sent
once decode is back are served exactly."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from cluster_harness import (
    complete_ids,
    metric_sum,
    router_decode,
    spread_prompt,
    start_cluster,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

HELD = 61
"""Prompt tokens of the requests held at prefill's door while decode is killed."""
NUM_HELD = 3


def test_requests_waiting_at_prefill_fail_fast_when_their_decode_dies(
    tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir: str
) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from protocol.sampling import SamplingParams

    ref = LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    release = tmp_path / "release"
    c = start_cluster(
        tmp_path,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        prefill={"handoff_faults": {"hold_prompt_tokens": HELD, "hold_until_file": str(release)}},
    )
    try:
        first = complete_ids(c, spread_prompt(30, 1))
        assert first["status"] == 200, first
        computed_before = metric_sum(
            c.prefill_url, "kvserve_prompt_tokens_total", source="computed"
        )
        assert computed_before >= 30
        aborted_before = metric_sum(
            c.prefill_url, "kvserve_prefill_requests_total", outcome="aborted"
        )

        held: list[dict] = [{} for _ in range(NUM_HELD)]
        threads = [
            threading.Thread(
                target=lambda i=i: held[i].update(complete_ids(c, spread_prompt(HELD, 50 + i)))
            )
            for i in range(NUM_HELD)
        ]
        for t in threads:
            t.start()
        assert wait_until(lambda: router_decode(c)["waiting_for_prefill"] == NUM_HELD, 60)

        os.kill(c.pids()["decode-0"], signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a request bound to the dead decode hung"
        for res in held:
            assert res["status"] == 503, res
            err = res["body"]["error"]
            assert err["code"] == "decode_instance_lost", err
            assert "decode instance decode-0" in err["message"], err
            # the router's health poll (1 s) or the restarted process, not prefill
            assert res["done_at"] - killed_at < 20, res["done_at"] - killed_at
        assert router_decode(c)["waiting_for_prefill"] == 0

        # Released now: prefill refuses them (their aborts came first), computes nothing.
        release.touch()
        assert wait_until(
            lambda: (
                metric_sum(c.prefill_url, "kvserve_prefill_requests_total", outcome="aborted")
                >= aborted_before + NUM_HELD
            ),
            30,
        )
        assert (
            metric_sum(c.prefill_url, "kvserve_prompt_tokens_total", source="computed")
            == computed_before
        )

        assert wait_until(lambda: router_decode(c)["healthy"], 180)
        prompts = [spread_prompt(20 + 7 * i, 200 + i) for i in range(4)]
        want = [str(x.text) for x in ref.generate(prompts, params)]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: complete_ids(c, p), prompts))
        for res, text in zip(results, want, strict=True):
            assert res["status"] == 200, res
            assert res["body"]["choices"][0]["text"] == text
    finally:
        res = c.down()
    assert res.returncode == 0, res.stderr

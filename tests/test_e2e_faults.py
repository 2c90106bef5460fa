"""A worker dies under a live cluster: its in-flight request fails fast with an error, the
next request gets a 5xx with a message (no hang), `kvserve status` shows it down, the
launcher starts it again and serving resumes, and `kvserve down` leaves no process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from cluster_harness import kvserve, start_cluster, wait_until

pytestmark = pytest.mark.timeout(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _complete(c, prompt: str = "hello") -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(
        c.api_base + "/completions",
        timeout=30,
        json={"model": c.served_name, "prompt": prompt, "max_tokens": 4},
    )


def test_decode_worker_killed_mid_stream(
    tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir: str
):
    c = start_cluster(tmp_path, str(tiny_llama_dir), cache_dir=weights_cache_dir)
    pids = c.pids()
    try:
        body = {
            "model": c.served_name,
            "prompt": "tool call " * 20,
            "max_tokens": 3000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        t0 = time.monotonic()
        with httpx.stream("POST", c.api_base + "/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            os.kill(pids["decode-0"], signal.SIGKILL)
            rest = list(lines)  # the stream must end (with an error), not hang
        assert time.monotonic() - t0 < 15
        tail = "\n".join(rest)
        assert '"error"' in tail, tail[-500:]

        # Right after the death (the launcher restarts it after a back-off and a reload).
        st = kvserve("status", "-c", str(c.config), "--state-dir", str(c.state_dir))
        assert st.returncode != 0, st.stdout
        row = next(ln for ln in st.stdout.splitlines() if ln.startswith("decode-0"))
        assert not row.rstrip().endswith(" up"), row
        t0 = time.monotonic()
        r = _complete(c)
        assert 500 <= r.status_code < 600, r.text
        assert r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10

        # The supervisor starts it again; the router sees it healthy and serves again.
        assert wait_until(lambda: _complete(c).status_code == 200, timeout_s=120, interval_s=1)
        new_pid = c.pids()["decode-0"]
        assert new_pid != pids["decode-0"]
        pids["decode-0-restarted"] = new_pid
    finally:
        res = c.down()
    assert res.returncode == 0, res.stderr
    assert wait_until(lambda: not any(_alive(p) for p in pids.values()), timeout_s=15)

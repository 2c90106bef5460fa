"""router.processes: N real router processes (`python -m router`) on one port in front of
stand-in workers: connections spread over them, each admits against 1/N of the decode
budget, a killed process is started again while the others serve, and stopping process
0 leaves none behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from router_standin import ServerThread, StandinWorker

from kvserve.process_groups import pid_alive

REPO = Path(__file__).resolve().parent.parent
CAPACITY = 1000
"""The decode stand-in's KV capacity: one gate's budget is 900 (headroom 0.9)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_yaml(prefill_port: int, decode_port: int, router_port: int, metrics_port: int) -> str:
    text = (REPO / "deploy/examples/local-pd.yaml").read_text()
    text = text.replace("port: 8100", f"port: {prefill_port}")
    text = text.replace("port: 8200", f"port: {decode_port}")
    return text.replace(
        "  port: 8000\n", f"  port: {router_port}\n  processes: 2\n  metrics_port: {metrics_port}\n"
    )


def _requests_served(metrics_url: str) -> int:
    text = httpx.get(metrics_url, trust_env=False, timeout=5).text
    counts = re.findall(r'^kvserve_router_requests_total\{[^}]*status="200"\} (\S+)$', text, re.M)
    return int(sum(float(c) for c in counts))


def _wait(what: str, ok: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ok():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _complete(url: str, max_tokens: int) -> httpx.Response:
    # A new connection per request: the kernel picks a process for each.
    return httpx.post(
        url + "/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": max_tokens},
        trust_env=False,
        timeout=30,
    )


def test_two_router_processes_share_the_port_and_the_budget(tmp_path: Path) -> None:
    prefill = StandinWorker(tokens=[100, 101, 102])
    decode = StandinWorker(tokens=[100, 101, 102], kv_capacity_tokens=CAPACITY)
    servers = [ServerThread(prefill.app()), ServerThread(decode.app())]
    for s in servers:
        s.start()
    port, metrics_port = _free_port(), _free_port()
    while metrics_port + 1 == port:
        metrics_port = _free_port()
    config = tmp_path / "cluster.yaml"
    config.write_text(_cluster_yaml(servers[0].port, servers[1].port, port, metrics_port))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "router", "-c", str(config)], env=env)
    url = f"http://127.0.0.1:{port}"
    metrics = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(2)]
    children: list[int] = []
    try:
        for m in metrics:
            _wait(m, lambda m=m: httpx.get(m, trust_env=False).status_code == 200)
        _wait("/health", lambda: httpx.get(url + "/health", trust_env=False).status_code == 200)
        children = [c.pid for c in psutil.Process(proc.pid).children()]
        assert len(children) == 1

        # Each process's gate holds half of decode's budget of 900: 450 tokens.
        def half_budget() -> bool:
            r = _complete(url, 460)  # prompt + 460 > 450
            return r.status_code == 400 and "largest decode budget is 450 tokens" in r.text

        for _ in range(6):  # both processes (6 connections) learn the capacity
            _wait("the budget from /info", half_budget)
        assert _complete(url, 400).status_code == 200

        num = 40
        for _ in range(num):
            r = _complete(url, 3)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        served = [_requests_served(m) for m in metrics]
        assert all(n > 0 for n in served), served  # 2^-39 that one process took them all
        assert sum(served) >= num + 1

        # Process 1 killed: the others serve meanwhile, process 0 starts it again.
        os.kill(children[0], signal.SIGKILL)
        # Its listening socket closes when it exits; a connection the kernel queued on it
        # before then is reset (what a client of a crashing process sees), so the others
        # are asked once it is gone.
        _wait("process 1 to exit", lambda: not pid_alive(children[0]), 15)
        for _ in range(10):
            assert _complete(url, 3).status_code == 200
        _wait(
            "process 1 started again",
            lambda: any(c.pid != children[0] for c in psutil.Process(proc.pid).children()),
        )
        _wait("process 1's metrics", lambda: _requests_served(metrics[1]) == 0)
        children = [c.pid for c in psutil.Process(proc.pid).children()]
        assert len(children) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for s in servers:
            s.stop()
    _wait("the other processes to end", lambda: not any(pid_alive(c) for c in children), 15)

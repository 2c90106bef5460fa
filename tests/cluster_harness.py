"""Start a real kvserve cluster with `kvserve up --detach` for end-to-end tests, on
127.0.0.1 with free ports, and stop it with `kvserve down`; and what the end-to-end
tests ask of one (completions, metrics, the router's view of decode, the reference
engine's greedy text)."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from protocol.cluster_checks import MOONCAKE_RPC_PORTS, MOONCAKE_STORE_CLIENT_PORTS


def internal_headers(state_dir: Path, cluster_name: str) -> dict[str, str]:
    """The cluster secret's header (what the router sends every worker), read from the
    run directory where `kvserve up` wrote it."""
    secret = (Path(state_dir) / cluster_name / "cluster_secret").read_text().strip()
    return {"authorization": f"Bearer {secret}"}


LOWEST_TEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that nothing holds now, for a cluster's components to bind.

    They lie below the kernel's ephemeral range: a port of that range, free when picked,
    can be taken as the local port of any outgoing connection (the cluster's own
    Mooncake, torch.distributed and HTTP clients) before the component binds it; a port
    below it only by a bind. None in Mooncake's RPC port range (MOONCAKE_RPC_PORTS: a
    port there, free when picked, can be taken by a store's or a worker's engine first)
    nor in its pool clients' (MOONCAKE_STORE_CLIENT_PORTS: a router once failed to bind
    a port a prefill's pool client had taken). Picked at random (not by the seeded
    `random` of the test run), so runs sharing the machine rarely pick the same one.
    """
    first_ephemeral, _ = _ephemeral_range()
    pick = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = pick.randrange(LOWEST_TEST_PORT, max(first_ephemeral, LOWEST_TEST_PORT + 1000))
        if port in ports or any(
            low <= port <= high for low, high in (MOONCAKE_RPC_PORTS, MOONCAKE_STORE_CLIENT_PORTS)
        ):
            continue
        with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT is not free
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def kvserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class Cluster:
    config: Path
    state_dir: Path
    router_url: str
    prefill_url: str
    decode_url: str
    served_name: str
    name: str = "e2e"
    pool_metrics_url: str | None = None
    """The pool master's /metrics base URL when the cluster runs a pool."""

    @property
    def api_base(self) -> str:
        return self.router_url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        """What internal calls to the workers carry (the cluster secret)."""
        return internal_headers(self.state_dir, self.name)

    def status(self, url: str) -> dict:
        return httpx.get(url + "/status", timeout=5, headers=self.headers).json()

    def idle(self) -> bool:
        """Nothing left on the workers: decode runs and waits for nothing, holds no KV
        block and no landing byte; prefill runs nothing."""
        d, p = self.status(self.decode_url), self.status(self.prefill_url)
        return (
            d["num_running"] == 0
            and d["num_waiting"] == 0
            and d["kv_blocks_free"] == d["kv_blocks_total"]
            and d["landing_bytes_used"] == 0
            and p["num_running"] == 0
        )

    def pids(self) -> dict[str, int]:
        state = json.loads((self.state_dir / self.name / "state.json").read_text())
        return {c["name"]: c["pid"] for c in state["components"]}

    def down(self) -> subprocess.CompletedProcess[str]:
        return kvserve("down", "-c", str(self.config), "--state-dir", str(self.state_dir))

    def stop(self) -> None:
        """`kvserve down`, which must succeed (the end of a fixture)."""
        res = self.down()
        assert res.returncode == 0, res.stderr

    def metric(self, url: str, name: str, **labels: str) -> float:
        return metric_sum(url, name, **labels)

    def reset(self) -> None:
        """Empty every instance's prefix cache (what is left is the pool's)."""
        r = httpx.post(self.router_url + "/v1/admin/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text


def router_section(
    port: int,
    served_model_name: str,
    *,
    timeout_s: float = 60,
    policy: str = "round_robin",
) -> dict:
    """The router section of a test cluster: on 127.0.0.1:port, no API key."""
    return {
        "host": "127.0.0.1",
        "port": port,
        "policy": policy,
        "served_model_name": served_model_name,
        "request_timeout_s": timeout_s,
    }


def pool_section(ports: list[int], store_size: str = "64MiB") -> dict:
    """An enabled shared pool on 127.0.0.1: master rpc, master metrics and one store
    (/health and /metrics) on the three `ports`."""
    return {
        "enabled": True,
        "master": {"node": "local", "port": ports[0], "metrics_port": ports[1]},
        "stores": [{"node": "local", "size": store_size, "metrics_port": ports[2]}],
    }


STOP_GRACE_S = 5


def launch(tmp: Path, cfg: dict, timeout: float = 300) -> tuple[Path, Path]:
    """Write `cfg` to tmp/cluster.yaml and `kvserve up --detach` it with its run state in
    tmp/state; returns (cluster file, state dir). Fails the test if `up` fails.

    `kvserve down` then gives the components STOP_GRACE_S after SIGTERM, not the default
    10 s: a component that hangs on its way out costs a test less (every component stops
    within about a second; the pool's master is stopped last, so a store's unmount does
    not wait for a master that is gone)."""
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = tmp / "state"
    args = ["--detach", "--state-dir", str(state), "--stop-grace", str(STOP_GRACE_S)]
    res = kvserve("up", "-c", str(config), *args, timeout=timeout)
    assert res.returncode == 0, f"kvserve up failed:\n{res.stdout}\n{res.stderr}"
    return config, state


def start_cluster(
    tmp: Path,
    model: str,
    *,
    cache_dir: str,
    extra: dict | None = None,
    name: str = "e2e",
    prefill: dict | None = None,
    decode: dict | None = None,
    pool: bool = False,
    router: dict | None = None,
) -> Cluster:
    """`kvserve up --detach` of one prefill, one decode and the router on free ports.

    `extra` replaces top-level sections; `prefill` / `decode` / `router` add or replace
    keys of the instance's (router's) section; `pool` adds a shared pool (master + one store, free ports)."""
    router_port, prefill_port, decode_port = free_ports(3)
    served = "e2e-model"
    cfg = {
        "name": name,
        "model": model,
        "dtype": "float32",
        "cache": {"block_size": 16, "chunk_size": 256, "weights_cache_dir": cache_dir},
        "nodes": [{"name": "local", "host": "127.0.0.1"}],
        "prefill": [
            {
                "name": "prefill-0",
                "node": "local",
                "port": prefill_port,
                "devices": ["cpu"],
                "max_batched_tokens": 512,
                "max_num_seqs": 32,
                "kv_cache_memory": "64MiB",
            }
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "local",
                "port": decode_port,
                "devices": ["cpu"],
                "max_num_seqs": 32,
                "kv_cache_memory": "64MiB",
                "landing_memory": "32MiB",
            }
        ],
        "router": router_section(router_port, served),
    }
    cfg["prefill"][0].update(prefill or {})
    cfg["decode"][0].update(decode or {})
    cfg["router"].update(router or {})
    pool_metrics_url = None
    if pool:
        ports = free_ports(3)
        cfg["pool"] = pool_section(ports)
        pool_metrics_url = f"http://127.0.0.1:{ports[1]}"
    for key, value in (extra or {}).items():
        cfg[key] = value
    config, state = launch(tmp, cfg)
    return Cluster(
        config,
        state,
        f"http://127.0.0.1:{router_port}",
        f"http://127.0.0.1:{prefill_port}",
        f"http://127.0.0.1:{decode_port}",
        served,
        name,
        pool_metrics_url,
    )


def wait_until(cond, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


# -- what the tests ask of a running cluster ---------------------------------------------


def spread_prompt(n: int, seed: int) -> list[int]:
    """n token ids of ordinary text-range tokens (distinct per seed: no prefix reuse)."""
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def complete_ids(c: Cluster, prompt: list[int], max_tokens: int = 8, timeout: float = 120) -> dict:
    """A greedy /v1/completions of token ids through the router: {"status", "body", "t0",
    "done_at"} (monotonic times around the call)."""
    started = time.monotonic()
    r = httpx.post(
        c.api_base + "/completions",
        json={
            "model": c.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=timeout,
        trust_env=False,
    )
    return {"status": r.status_code, "body": r.json(), "done_at": time.monotonic(), "t0": started}


def greedy_text(ref, prompt: list[int], max_tokens: int = 8) -> str:  # type: ignore[no-untyped-def]
    """The single-process engine's greedy completion text of `prompt` (ignoring EOS)."""
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return str(ref.generate([prompt], params)[0].text)


def router_decode(c: Cluster) -> dict:
    """The router's view of the first decode instance (GET /health)."""
    body = httpx.get(c.router_url + "/health", timeout=5, trust_env=False).json()
    return dict(body["decode"]["instances"][0])


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of series `name` on url/metrics whose labels include `labels`
    (every sample when none are given; 0 when there is none)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total

"""Start a real pool for tests: `python -m kvpool.master` and two `python -m kvpool.store`
processes on 127.0.0.1 with free ports (Mooncake over tcp on loopback), from a small
cluster.yaml whose prefill/decode sections are never started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from cluster_harness import free_ports

ROOT = str(Path(__file__).resolve().parent.parent)


def pool_cluster_dict(
    ports: list[int],
    *,
    store_sizes: tuple[str, ...] = ("64MiB", "64MiB"),
    lease_ttl_s: float = 10.0,
    client_ttl_s: float = 10.0,
    host: str = "127.0.0.1",
) -> dict:
    """A valid cluster.yaml dict whose pool section uses `ports`: master rpc, master
    metrics, then one /health port per store."""
    return {
        "name": "pooltest",
        "model": "builtin:smollm2-135m-instruct",
        "nodes": [{"name": "local", "host": host}],
        "pool": {
            "enabled": True,
            "master": {
                "node": "local",
                "port": ports[0],
                "metrics_port": ports[1],
                "lease_ttl_s": lease_ttl_s,
                "client_ttl_s": client_ttl_s,
            },
            "stores": [
                {"node": "local", "numa_node": i, "size": size, "metrics_port": ports[2 + i]}
                for i, size in enumerate(store_sizes)
            ],
        },
        "prefill": [{"name": "p", "node": "local", "port": ports[-2], "devices": ["cpu"]}],
        "decode": [{"name": "d", "node": "local", "port": ports[-1], "devices": ["cpu"]}],
    }


@dataclass
class Pool:
    """A running master and its stores; stop() ends them (SIGTERM, then SIGKILL)."""

    config: Path
    master_address: str
    metrics_url: str
    store_health_urls: list[str]
    capacity_bytes: int
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def master_metric(self, name: str) -> float:
        text = httpx.get(self.metrics_url + "/metrics", timeout=5).text
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        """Stores first (they unmount from a live master), then the master."""
        stores = [p for name, p in self.procs.items() if name != "master"]
        for group in (stores, [self.procs["master"]] if "master" in self.procs else []):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)


def _env(host: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = host
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def spawn(pool: Pool, name: str, argv: list[str], host: str = "127.0.0.1") -> None:
    log = open(pool.logs / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
    pool.procs[name] = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=_env(host), start_new_session=True
    )


def master_argv(config: Path) -> list[str]:
    return [sys.executable, "-m", "kvpool.master", "-c", str(config), "--node", "local"]


def store_argv(config: Path, index: int) -> list[str]:
    return [sys.executable, "-m", "kvpool.store", "-c", str(config), "--index", str(index)]


def wait_healthy(
    url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} (see its log)")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


def start_pool(tmp: Path, **kw: object) -> Pool:
    """Master + stores as in pool_cluster_dict(**kw), healthy, capacity mounted."""
    sizes = kw.get("store_sizes", ("64MiB", "64MiB"))
    assert isinstance(sizes, tuple)
    ports = free_ports(4 + len(sizes))
    cfg = pool_cluster_dict(ports, **kw)  # type: ignore[arg-type]
    config = tmp / "pool.yaml"
    config.write_text(yaml.safe_dump(cfg))
    host = cfg["nodes"][0]["host"]
    from protocol.cluster import load_cluster

    cluster = load_cluster(config)
    assert cluster.pool is not None
    capacity = sum(int(s.size) for s in cluster.pool.stores)
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    pool = Pool(
        config,
        f"{host}:{ports[0]}",
        f"http://{host}:{ports[1]}",
        [f"http://{host}:{p}/health" for p in ports[2 : 2 + len(sizes)]],
        capacity,
        logs,
    )
    try:
        spawn(pool, "master", master_argv(config), host)
        wait_healthy(pool.metrics_url + "/health", proc=pool.procs["master"])
        for i in range(len(sizes)):
            spawn(pool, f"store{i}", store_argv(config, i), host)
        for i, url in enumerate(pool.store_health_urls):
            wait_healthy(url, proc=pool.procs[f"store{i}"])
        deadline = time.monotonic() + 30
        while pool.master_metric("master_total_capacity_bytes") < capacity:
            assert time.monotonic() < deadline, "stores did not mount their segments"
            time.sleep(0.1)
    except BaseException:
        pool.stop()
        raise
    return pool


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            if v6:
                addr = "::" if int(addr_hex, 16) == 0 else addr_hex
            else:
                addr = ".".join(str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            out.append((addr, int(port_hex, 16)))
    return out

"""What the soak run samples every few seconds: RSS of every component, KV / landing / pool
occupancy from the metrics endpoints, and everything a leftover check needs afterwards
(every process id seen, with its start time, and every /dev/shm file a process mapped).

Components are read from the launcher's state file each time, so a component restarted
under a new pid is followed. RSS is that of the component's whole process tree (a PP
prefill or TP decode instance is several processes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from kvserve.run_state import RunDir

SHM = "/dev/shm/"


@dataclass
class Sample:
    """One sample: seconds since the soak started, then series name -> value."""

    t_s: float
    values: dict[str, float]


@dataclass
class Seen:
    """Every process and shared-memory file the cluster used (for the leftover check)."""

    pids: dict[int, float] = field(default_factory=dict)
    """pid -> create_time (a reused pid is not ours)."""
    shm_files: set[str] = field(default_factory=set)
    ports: set[int] = field(default_factory=set)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> sum over its label sets (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class Watcher(threading.Thread):
    """Samples the running cluster every `interval_s` until stop() (a daemon thread)."""

    def __init__(self, run: RunDir, t0: float, interval_s: float) -> None:
        super().__init__(name="soak-watch", daemon=True)
        self.run_dir = run
        self.t0 = t0
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.seen = Seen()
        self._halt = threading.Event()
        self._http = httpx.Client(timeout=2.0, trust_env=False)
        self._n = 0

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        self._http.close()

    def run(self) -> None:
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.sample())
            except Exception as e:  # a torn moment (restart) must not end the watch
                print(f"[soak] sample failed: {type(e).__name__}: {e}", flush=True)
            self._halt.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def sample(self) -> Sample:
        t_s = time.monotonic() - self.t0
        state = self.run_dir.read()
        values: dict[str, float] = {}
        if state is not None:
            self.seen.pids[state.launcher_pid] = _create_time(state.launcher_pid)
            for c in state.components:
                self.seen.ports.add(c.port)
                procs = process_tree(c.pid)
                rss = 0
                for p in procs:
                    try:
                        rss += p.memory_info().rss
                        self.seen.pids.setdefault(p.pid, p.create_time())
                        if self._n % 5 == 0:  # memory_maps is slow: every 5th sample
                            self.seen.shm_files.update(
                                m.path for m in p.memory_maps() if m.path.startswith(SHM)
                            )
                    except psutil.Error:
                        continue
                if rss:  # 0: the process died while being read (a fault)
                    values[f"rss_mb:{c.name}"] = rss / 2**20
                    values[f"pid:{c.name}"] = c.pid
                base = c.health_url.rsplit("/", 1)[0]
                if c.kind in ("prefill", "decode", "pool_master"):
                    self._scrape(c.name, c.kind, base + "/metrics", values)
        self._n += 1
        return Sample(t_s, values)

    def _scrape(self, name: str, kind: str, url: str, values: dict[str, float]) -> None:
        try:
            r = self._http.get(url)
            if r.status_code != 200:
                return
        except httpx.HTTPError:
            return  # down (a fault): the gap shows in the plot
        m = parse_metrics(r.text)
        if kind in ("prefill", "decode") and "kvserve_kv_cache_usage_ratio" in m:
            values[f"kv_usage:{name}"] = m["kvserve_kv_cache_usage_ratio"]
        if kind == "decode" and m.get("kvserve_landing_capacity_bytes"):
            used = m.get("kvserve_landing_used_bytes", 0.0)
            values[f"landing_usage:{name}"] = used / m["kvserve_landing_capacity_bytes"]
        if kind == "pool_master" and m.get("master_total_capacity_bytes"):
            alloc = m.get("master_allocated_bytes", 0.0)
            values["pool_usage"] = alloc / m["master_total_capacity_bytes"]


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


@dataclass
class Leftovers:
    processes: list[str]
    listening: list[str]
    shm_files: list[str]
    run_state: list[str]

    @property
    def clean(self) -> bool:
        return not (self.processes or self.listening or self.shm_files or self.run_state)


def leftovers(seen: Seen, run: RunDir, wait_s: float = 10.0) -> Leftovers:
    """What is still there after `kvserve down` (a process gets `wait_s` to finish dying)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid, created in sorted(seen.pids.items()):
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    listening = [
        f"{c.laddr.ip}:{c.laddr.port} (pid {c.pid})"
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and (c.laddr.port in seen.ports or c.pid in seen.pids)
    ]
    shm = sorted(f for f in seen.shm_files if Path(f).exists())
    state = [str(p) for p in (run.state_file,) if p.exists()]
    return Leftovers(alive, listening, shm, state)

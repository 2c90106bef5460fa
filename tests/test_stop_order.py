"""How a cluster stops: the pool's master after every other component (a store unmounts
through it), both when the launcher stops the cluster and when `kvserve down` stops what
a killed launcher left (kvserve/supervisor.py stop_in_order)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

from test_launcher import REPO, Cluster

from kvserve import launcher
from kvserve.components import ComponentSpec
from kvserve.run_state import RunDir
from kvserve.supervisor import Supervisor

STOP_RECORDER = r"""
import os, signal, subprocess, sys, time
name, out, exit_delay_s, role = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
if role == "leader":  # a component whose worker process (same group) outlives it
    subprocess.Popen([sys.executable, __file__, name, out, str(exit_delay_s), "recorder"])
    while True:
        time.sleep(1)
def on_term(*_):
    with open(os.path.join(out, name), "w") as f:
        f.write(f"{time.time()} ")  # SIGTERM arrived
        time.sleep(exit_delay_s)  # e.g. a store unmounting its segment through the master
        f.write(f"{time.time()}")  # exiting
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, name + ".ready"), "w").close()
while True:
    time.sleep(1)
"""

STOP_DELAYS = {"pool-master": 0.0, "pool-store-0": 0.5, "prefill-0": 0.3, "router": 0.0}
"""Seconds from SIGTERM to exit per component, started in this order."""


def recorder_specs(tmp_path: Path, role: str) -> tuple[list[ComponentSpec], Path]:
    """Components that write when SIGTERM reached them and when they exited, into out/."""
    script = tmp_path / "recorder.py"
    script.write_text(STOP_RECORDER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    kinds = {"pool-master": "pool_master", "pool-store-0": "pool_store"}
    specs = [
        ComponentSpec(
            name=name,
            kind=kinds.get(name, name.split("-")[0]),
            node="local",
            host="127.0.0.1",
            port=0,
            argv=(sys.executable, str(script), name, str(out), str(delay), role),
        )
        for name, delay in STOP_DELAYS.items()
    ]
    return specs, out


def wait_recorders(out: Path) -> None:
    deadline = time.monotonic() + 10
    while not all((out / f"{n}.ready").exists() for n in STOP_DELAYS):
        assert time.monotonic() < deadline, "the recorders did not start"
        time.sleep(0.02)


def assert_master_stopped_last(out: Path) -> None:
    times = {n: [float(x) for x in (out / n).read_text().split()] for n in STOP_DELAYS}
    master_term = times["pool-master"][0]
    assert all(len(t) == 2 for t in times.values()), times  # each exited on SIGTERM
    assert all(times[n][1] <= master_term for n in STOP_DELAYS if n != "pool-master"), times
    assert times["pool-store-0"][0] < times["prefill-0"][1]  # the others at once


def test_the_pool_master_stops_after_every_other_component(tmp_path: Path) -> None:
    """Stopping a cluster: every component but the pool's master gets SIGTERM at once, the
    master only once they have exited (a store unmounts through it), all within the
    grace."""
    specs, out = recorder_specs(tmp_path, "recorder")
    run = RunDir(tmp_path / "state", "order")
    run.logs.mkdir(parents=True)
    sup = Supervisor(
        run,
        [specs],
        cluster_name="order",
        config_path="cluster.yaml",
        endpoint=None,
        health_timeout_s=5.0,
        stop_grace_s=5.0,
        out=io.StringIO(),
    )
    sup._start_stage(specs)
    wait_recorders(out)
    t0 = time.monotonic()
    sup._stop_all()
    assert time.monotonic() - t0 < 3.0  # nobody waited out the grace
    assert_master_stopped_last(out)


KILLED_LAUNCHER = r"""
import io, json, sys, time
from kvserve.components import ComponentSpec
from kvserve.run_state import RunDir
from kvserve.supervisor import Supervisor
state_dir, cluster_name, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
stage = [ComponentSpec(**{**s, "argv": tuple(s["argv"])}) for s in specs]
run = RunDir(state_dir, cluster_name)
run.logs.mkdir(parents=True)
sup = Supervisor(run, [stage], cluster_name=cluster_name, config_path="cluster.yaml",
                 endpoint=None, health_timeout_s=5.0, stop_grace_s=5.0, out=io.StringIO())
sup._start_stage(stage)
sup._write("running")
time.sleep(600)
"""


def test_down_after_a_killed_launcher_stops_the_pool_master_last(tmp_path: Path) -> None:
    """The launcher is killed (SIGKILL): its components' leaders die with it, their worker
    processes stay; `down` stops those groups in the launcher's order, the master last."""
    c = Cluster(tmp_path)
    specs, out = recorder_specs(tmp_path, "leader")
    fields = ("name", "kind", "node", "host", "port", "argv")
    argv = [sys.executable, "-c", KILLED_LAUNCHER, str(c.state_dir), "standin"]
    argv.append(json.dumps([{f: getattr(s, f) for f in fields} for s in specs]))
    proc = subprocess.Popen(argv, cwd=REPO)
    try:
        wait_recorders(out)
        c.wait_phase("running")
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        assert launcher.down(c.config, c.state_dir, stop_grace_s=5.0, out=io.StringIO()) == 0
        assert time.monotonic() - t0 < 3.0  # nobody waited out the grace
    finally:
        c.cleanup(proc)
    assert_master_stopped_last(out)
    assert c.state() is None

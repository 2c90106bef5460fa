"""kvserve up/down/status with stand-in components (the real ones are tested end to end
elsewhere): a small HTTP server per component that can crash, hang, ignore SIGTERM or
die later, and that records its environment and the pid of a grandchild it spawns."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from cluster_harness import free_ports

from kvserve import launcher
from kvserve.launcher import LaunchOptions
from kvserve.supervisor import LaunchError

REPO = Path(__file__).resolve().parent.parent

STANDIN = r"""
import http.client, http.server, json, os, signal, subprocess, sys, threading, time
name, kind, host, port, out = sys.argv[1:6]
mode = json.loads(open(os.path.join(out, "modes.json")).read()).get(name, "ok")
with open(os.path.join(out, name + ".env.json"), "w") as f:
    json.dump(dict(os.environ), f)
with open(os.path.join(out, name + ".argv.json"), "w") as f:
    json.dump(sys.argv, f)
secret = os.environ.get("KVSERVE_CLUSTER_SECRET", "")
child = subprocess.Popen(["sleep", "600"])  # a grandchild of the launcher
with open(os.path.join(out, name + ".pids"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
if mode == "crash":
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode.startswith("die_after"):
    delay = float(mode.split(":")[1])
    threading.Timer(delay, lambda: (print("dying now", flush=True), os._exit(4))).start()
status = {"name": name, "role": kind, "healthy": True, "num_running": 1, "num_waiting": 2,
          "kv_blocks_total": 100, "kv_blocks_free": 97}

def router_health():
    # as the real router: each instance's health as its own GET /health answers it
    # (mode "blind": as a router that never reaches its instances)
    instances = json.loads(open(os.path.join(out, "instances.json")).read())
    health = {"status": "ok"}
    for role, entries in instances.items():
        listed = []
        for inst_name, inst_port in entries:
            try:
                conn = http.client.HTTPConnection(host, inst_port, timeout=0.5)
                conn.request("GET", "/health")
                up = conn.getresponse().status == 200 and mode != "blind"
                conn.close()
            except OSError:
                up = False
            listed.append({"name": inst_name, "healthy": up})
        health[role] = {"total": len(listed), "instances": listed}
    return json.dumps(health).encode()

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            if mode == "never":
                code, body = 503, b"loading"
            else:
                code, body = 200, router_health() if kind == "router" else b"ok"
        elif self.path == "/status" and kind != "router":
            # as a real worker: /status is internal, the cluster secret is required
            if secret and self.headers.get("authorization") == "Bearer " + secret:
                code, body = 200, json.dumps(status).encode()
            else:
                code, body = 401, b"{}"
        else:
            code, body = 404, b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

print(f"{name} listening on {host}:{port}", flush=True)
http.server.HTTPServer((host, int(port)), H).serve_forever()
"""


class Cluster:
    """A cluster.yaml of stand-ins in a tmp dir, with their modes and outputs."""

    def __init__(self, tmp: Path, modes: dict[str, str] | None = None) -> None:
        self.out = tmp / "out"
        self.out.mkdir()
        self.state_dir = tmp / "state"
        (self.out / "modes.json").write_text(json.dumps(modes or {}))
        script = tmp / "standin.py"
        script.write_text(STANDIN)
        argv = [sys.executable, str(script), "{name}", "{kind}", "{host}", "{port}", str(self.out)]
        self.commands = {kind: argv for kind in ("router", "prefill", "decode")}
        self.router_port, p_port, d_port, dist = free_ports(4)
        instances = {"prefill": [["prefill-0", p_port]], "decode": [["decode-0", d_port]]}
        (self.out / "instances.json").write_text(json.dumps(instances))
        self.config = tmp / "cluster.yaml"
        self.config.write_text(
            f"""
name: standin
model: builtin:smollm2-135m-instruct
dtype: float32
nodes: [{{name: local, host: 127.0.0.1}}]
prefill:
  - {{name: prefill-0, node: local, port: {p_port}, devices: [cpu]}}
decode:
  - name: decode-0
    node: local
    port: {d_port}
    devices: [cpu]
    dist_port: {dist}
    env: {{KVSERVE_TEST_EXTRA: "yes"}}
router: {{port: {self.router_port}}}
"""
        )
        self.dist_port = dist

    def options(self, **kw: object) -> LaunchOptions:
        base: dict[str, object] = dict(
            state_dir=self.state_dir,
            commands=self.commands,
            health_timeout_s=15.0,
            stop_grace_s=3.0,
        )
        base.update(kw)
        return LaunchOptions(**base)  # type: ignore[arg-type]

    def cleanup(self, proc: subprocess.Popen[str]) -> None:
        """After a failed test: leave nothing running."""
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self.cli("down", "--stop-grace", "1")

    def driver(self, detach: bool = False) -> subprocess.Popen[str]:
        """`up` in its own process, as a terminal user would run it."""
        code = (
            "import json, sys; from kvserve.launcher import up, LaunchOptions; "
            "sys.exit(up(sys.argv[1], LaunchOptions(state_dir=sys.argv[2], "
            "commands=json.loads(sys.argv[3]), health_timeout_s=15, stop_grace_s=1.0, "
            f"detach={detach})))"
        )
        argv = [sys.executable, "-c", code, str(self.config), str(self.state_dir)]
        argv.append(json.dumps(self.commands))
        return subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def pids(self, name: str) -> list[int]:
        return [int(p) for p in (self.out / f"{name}.pids").read_text().split()]

    def env(self, name: str) -> dict[str, str]:
        return json.loads((self.out / f"{name}.env.json").read_text())

    def state(self) -> dict | None:
        path = self.state_dir / "standin" / "state.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_phase(self, phase: str, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state()
            if st and st["phase"] == phase:
                return st
            time.sleep(0.05)
        raise AssertionError(f"state never reached {phase}: {self.state()}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kvserve.cli", *args, "-c", str(self.config)]
        if args[0] != "check":
            argv += ["--state-dir", str(self.state_dir)]
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def assert_all_gone(c: Cluster, names: list[str], timeout_s: float = 5.0) -> None:
    pids = [p for n in names if (c.out / f"{n}.pids").exists() for p in c.pids(n)]
    assert pids
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes left behind"


ALL = ["router", "prefill-0", "decode-0"]


def test_up_status_down_foreground(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    proc = c.driver()
    try:
        st = c.wait_phase("running")
        assert [x["name"] for x in st["components"]] == ["prefill-0", "decode-0", "router"]
        assert st["endpoint"] == f"http://127.0.0.1:{c.router_port}/v1"

        res = c.cli("status")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "prefill-0" in res.stdout and "decode-0" in res.stdout and "router" in res.stdout
        assert "97/100" in res.stdout  # /status → InstanceStatus of the workers
        rows = [
            line.split()
            for line in res.stdout.splitlines()
            if line.split()[:1] in (["prefill-0"], ["decode-0"], ["router"])
        ]
        assert len(rows) == 3 and all(row[-1] == "up" for row in rows), res.stdout

        with pytest.raises(LaunchError, match="already running"):
            launcher.up(c.config, c.options(), out=io.StringIO())

        res = c.cli("down")
        assert res.returncode == 0, res.stdout + res.stderr
        output, _ = proc.communicate(timeout=15)
    finally:
        c.cleanup(proc)
    assert proc.returncode == 0, output
    assert f"endpoint: http://127.0.0.1:{c.router_port}/v1" in output
    assert str(c.state_dir / "standin" / "logs") in output
    assert_all_gone(c, ALL)  # components and their grandchildren
    assert c.state() is None
    assert c.cli("status").returncode == 1


def test_children_get_env_from_config(tmp_path: Path) -> None:
    c = Cluster(tmp_path, modes={"router": "die_after:0.3"})
    code = launcher.up(c.config, c.options(), out=io.StringIO())
    assert code == 1  # the router died after the launch: everything stops
    for name in ALL:
        env = c.env(name)
        assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert c.env("decode-0")["MASTER_PORT"] == str(c.dist_port)
    assert c.env("decode-0")["KVSERVE_TEST_EXTRA"] == "yes"
    assert "MASTER_PORT" not in c.env("prefill-0")
    # one random cluster secret per run, in the run directory (0600) and the components'
    # environment, never on their command lines
    secret_file = c.state_dir / "standin" / "cluster_secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    assert len(secret) >= 32
    for name in ALL:
        assert c.env(name)["KVSERVE_CLUSTER_SECRET"] == secret
        assert not any(
            secret in arg for arg in json.loads((c.out / f"{name}.argv.json").read_text())
        )
    assert_all_gone(c, ALL)


def test_crash_at_start_stops_the_others(tmp_path: Path) -> None:
    c = Cluster(tmp_path, modes={"prefill-0": "crash"})
    out = io.StringIO()
    assert launcher.up(c.config, c.options(), out=out) == 1
    text = out.getvalue()
    assert "prefill-0 exited with code 3" in text
    assert "boom: cannot load the model" in text  # the log tail
    assert_all_gone(c, ALL)  # the router starts beside the workers: stopped with them
    assert c.state() is None


def test_never_healthy_times_out(tmp_path: Path) -> None:
    c = Cluster(tmp_path, modes={"decode-0": "never"})
    out = io.StringIO()
    assert launcher.up(c.config, c.options(health_timeout_s=1.0), out=out) == 1
    assert "decode-0 not healthy after 1s" in out.getvalue()
    assert "503" in out.getvalue()
    assert_all_gone(c, ALL)


def test_the_router_is_started_once_it_sees_every_worker(tmp_path: Path) -> None:
    """The router starts beside the workers; it counts as started only when its GET
    /health shows every worker of the launch healthy, so the cluster is never reported
    ready while the router would still refuse requests."""
    c = Cluster(tmp_path)
    proc = c.driver()
    try:
        c.wait_phase("running")
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=15)
        c.cleanup(proc)
    lines = output.splitlines()
    started = [i for i, line in enumerate(lines) if line.startswith("[kvserve] started ")]
    healthy = [i for i, line in enumerate(lines) if line.endswith("s)") and "healthy" in line]
    # all three started before any is healthy (one stage), the router healthy last
    assert len(started) == 3 and len(healthy) == 3 and max(started) < min(healthy), output
    assert lines[healthy[-1]].startswith("[kvserve] router is healthy"), output

    (tmp_path / "blind").mkdir()
    blind = Cluster(tmp_path / "blind", modes={"router": "blind"})
    out = io.StringIO()
    assert launcher.up(blind.config, blind.options(health_timeout_s=1.5), out=out) == 1
    text = out.getvalue()
    assert "prefill-0 is healthy" in text and "decode-0 is healthy" in text
    assert "router not healthy after 1.5s" in text, text
    assert "it does not see prefill-0, decode-0 healthy yet" in text, text
    assert_all_gone(blind, ALL)


def test_detach_then_down_kills_a_stubborn_component(tmp_path: Path) -> None:
    c = Cluster(tmp_path, modes={"decode-0": "stubborn"})
    proc = c.driver(detach=True)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"endpoint: http://127.0.0.1:{c.router_port}/v1" in output
    st = c.state()
    assert st is not None and st["phase"] == "running"
    assert all(alive(c.pids(n)[0]) for n in ALL)
    assert alive(st["launcher_pid"])

    res = c.cli("down", "--stop-grace", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert_all_gone(c, ALL)
    assert not alive(st["launcher_pid"])
    log = (c.state_dir / "standin" / "launcher.log").read_text()
    assert "decode-0 ignored SIGTERM" in log


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    proc = c.driver()
    try:
        c.wait_phase("running")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=15)
    finally:
        c.cleanup(proc)
    assert proc.returncode == 0, output
    assert "SIGINT: stopping the cluster" in output
    assert_all_gone(c, ALL)


def test_busy_port_fails_before_starting(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", c.router_port))
        s.listen()
        with pytest.raises(LaunchError, match=r"router\.port: cannot listen"):
            launcher.up(c.config, c.options(), out=io.StringIO())
    assert not (c.out / "prefill-0.pids").exists()


def test_down_and_status_when_nothing_runs(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    res = c.cli("down")
    assert res.returncode == 0 and "not running" in res.stdout
    res = c.cli("status")
    assert res.returncode == 1
    assert "connection refused" in res.stdout


def test_down_cleans_up_after_a_killed_launcher(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    proc = c.driver()
    try:
        c.wait_phase("running")
        proc.kill()  # SIGKILL: no cleanup; components die by PDEATHSIG, grandchildren stay
        proc.wait()
        grandchildren = [c.pids(n)[1] for n in ALL]
        time.sleep(0.3)
        assert all(alive(p) for p in grandchildren)
        with pytest.raises(LaunchError, match="previous run are still alive"):
            launcher.up(c.config, c.options(), out=io.StringIO())
        res = c.cli("down", "--stop-grace", "1")
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        c.cleanup(proc)
    assert_all_gone(c, ALL)
    assert c.state() is None


def test_router_processes_in_status_and_gone_after_down(tmp_path: Path) -> None:
    """The real router with router.processes 2 (stand-in workers): `kvserve status` shows
    each process through its own metrics port, and `kvserve down` leaves none."""
    c = Cluster(tmp_path)
    del c.commands["router"]  # the real `python -m router`
    (metrics_port,) = free_ports(1)
    text = c.config.read_text().replace(
        f"router: {{port: {c.router_port}}}",
        f"router: {{port: {c.router_port}, processes: 2, metrics_port: {metrics_port}}}",
    )
    c.config.write_text(text)
    proc = c.driver(detach=True)
    try:
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        st = c.state()
        assert st is not None
        (router_pid,) = [x["pid"] for x in st["components"] if x["name"] == "router"]
        deadline = time.monotonic() + 30
        while True:  # process 1 loads the tokenizer after process 0 is up
            res = c.cli("status")
            rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line}
            if res.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert res.returncode == 0, res.stdout + res.stderr
        assert rows["router/0"][3] == f"127.0.0.1:{metrics_port}" and rows["router/0"][-1] == "up"
        assert rows["router/1"][3] == f"127.0.0.1:{metrics_port + 1}"
        assert rows["router/1"][-1] == "up"
        children = [p.pid for p in psutil.Process(router_pid).children()]
        assert len(children) == 1
        res = c.cli("down")
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        c.cleanup(proc)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in [router_pid, *children]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in [router_pid, *children] if alive(p)], "router processes left behind"
    log = (c.state_dir / "standin" / "logs" / "router.log").read_text()
    assert "process 1 of 2" in log  # it served
    assert "starting it again" not in log  # `down` stopped it: not a crash to restart

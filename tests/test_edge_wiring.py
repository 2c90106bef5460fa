"""router.data_plane: native (router/edge.py): the cluster.yaml keys and their checks, the
EdgeConfig the router writes (every field of edge/src/config.rs), the edge process's
start / restart / stop, the errors of a router that cannot have the native data plane,
and a real `python -m router` with the real edge in front of stand-in workers: served
and proxied requests through router.port, the edge killed and started again, nothing
left after the router stops, and who listens where."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from cluster_harness import free_ports
from router_standin import ServerThread, StandinWorker, smollm2_info

from kvserve.cluster_summary import summarize
from kvserve.process_groups import pid_alive
from protocol.cluster import parse_cluster
from protocol.config_errors import ConfigError
from router.config import RouterSettings, settings_from_cluster
from router.edge import edge_config, served_model_names, write_edge_files
from router.edge_process import EdgeError, EdgeProcess

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "deploy" / "examples" / "local-pd.yaml"


def _cluster(**router: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(LOCAL.read_text())
    data["router"].update(router)
    return data


def test_data_plane_defaults_to_python() -> None:
    settings = settings_from_cluster(parse_cluster(_cluster()))
    assert settings.data_plane == "python" and settings.edge_threads == 0


def test_native_with_threads_reaches_the_settings() -> None:
    cluster = parse_cluster(_cluster(data_plane="native", edge_threads=6))
    settings = settings_from_cluster(cluster)
    assert settings.data_plane == "native" and settings.edge_threads == 6
    assert "; native data plane (kvserve-edge)" in summarize(cluster, "cluster.yaml")
    assert "native" not in summarize(parse_cluster(_cluster()), "cluster.yaml")


@pytest.mark.parametrize(
    ("router", "path", "fragment"),
    [
        (
            {"data_plane": "native", "processes": 2, "metrics_port": 9300},
            "router.processes",
            "router.data_plane native needs 1",
        ),
        ({"edge_threads": 4}, "router.edge_threads", "router.data_plane is python"),
        ({"data_plane": "rust"}, "router.data_plane", "python"),
        ({"data_plane": "native", "edge_threads": -1}, "router.edge_threads", ">= 0"),
    ],
)
def test_bad_data_plane_keys_name_their_path(
    router: dict[str, Any], path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(_cluster(**router), "cluster.yaml")
    assert info.value.path == path, str(info.value)
    assert fragment in str(info.value)


def _config_rs_fields() -> set[str]:
    source = (REPO / "edge" / "src" / "config.rs").read_text()
    struct = source[source.index("pub struct EdgeConfig") :]
    struct = struct[: struct.index("\n}")]
    return set(re.findall(r"^\s*pub (\w+):", struct, re.M))


def test_edge_config_has_every_field_of_config_rs(tmp_path: Path) -> None:
    model = smollm2_info()
    settings = RouterSettings(
        model="builtin:smollm2-135m-instruct",
        served_model_name="smol",
        host="127.0.0.1",
        port=8123,
        api_key="k",
        edge_threads=3,
        data_plane="native",
    )
    files = write_edge_files(settings, model, "http://127.0.0.1:9999")
    try:
        assert oct(files.directory.stat().st_mode & 0o777) == "0o700"
        assert oct(files.config.stat().st_mode & 0o777) == "0o600"
        config = edge_config(settings, model, files, "http://127.0.0.1:9999")
        missing = _config_rs_fields() - set(config)
        assert not missing, f"EdgeConfig fields the router does not write: {missing}"
        assert config["listen_host"] == "127.0.0.1" and config["listen_port"] == 8123
        assert config["python_url"] == "http://127.0.0.1:9999"
        assert config["served_model_names"][0] == "smol"
        assert "builtin:smollm2-135m-instruct" in config["served_model_names"]
        assert config["eos_token_ids"] == list(model.eos_token_ids)
        assert config["max_model_len"] == model.max_context_len
        assert config["worker_threads"] == 3 and config["api_key"] == "k"
        assert Path(config["tokenizer_path"]).read_text().startswith("{")
    finally:
        import shutil

        shutil.rmtree(files.directory)
    assert served_model_names(settings, model) == config["served_model_names"]


# A stand-in for the binary: what EdgeProcess needs of it (a listening line on stdout,
# SIGTERM to stop), with knobs from the environment.
_FAKE_EDGE = textwrap.dedent(
    """\
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if os.environ.get("FAKE_EDGE_EXIT"):
        print("cannot start", flush=True)
        sys.exit(int(os.environ["FAKE_EDGE_EXIT"]))
    if not os.environ.get("FAKE_EDGE_SILENT"):
        print("a line before", flush=True)
        print("kvserve-edge listening on 127.0.0.1:4242", flush=True)
    if os.environ.get("FAKE_EDGE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
    """
)


def _fake_edge(tmp_path: Path, **env: str) -> EdgeProcess:
    script = tmp_path / "fake_edge.py"
    script.write_text(_FAKE_EDGE)
    return EdgeProcess([sys.executable, str(script)], {**os.environ, **env}, ready_timeout_s=5.0)


def test_edge_process_waits_for_listening_then_stops(tmp_path: Path) -> None:
    async def run() -> None:
        edge = _fake_edge(tmp_path)
        assert await edge.start() == "127.0.0.1:4242"
        pid = edge.pid
        assert pid is not None and pid_alive(pid)
        await edge.stop()
        assert not pid_alive(pid)

    asyncio.run(run())


def test_edge_process_restarts_after_it_dies(tmp_path: Path) -> None:
    async def run() -> None:
        edge = _fake_edge(tmp_path)
        await edge.start()
        first = edge.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while edge.pid in (None, first) or edge.address is None:
            assert time.monotonic() < deadline, "the edge was not started again"
            await asyncio.sleep(0.05)
        assert edge.address == "127.0.0.1:4242"
        second = edge.pid
        await edge.stop()
        assert second is not None and not pid_alive(second)

    asyncio.run(run())


def test_edge_process_is_not_restarted_while_the_router_stops(tmp_path: Path) -> None:
    async def run() -> None:
        stopping = False
        edge = _fake_edge(tmp_path)
        edge._stopping = lambda: stopping
        await edge.start()
        first = edge.pid
        assert first is not None
        stopping = True
        os.kill(first, signal.SIGTERM)  # `kvserve down` signals the whole group
        await asyncio.sleep(1.5)  # past the first restart delay
        assert edge.pid is None
        await edge.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("env", "fragment"),
    [({"FAKE_EDGE_EXIT": "3"}, "exited with code 3"), ({"FAKE_EDGE_SILENT": "1"}, "within")],
)
def test_edge_process_that_never_listens_is_a_clear_error(
    tmp_path: Path, env: dict[str, str], fragment: str
) -> None:
    async def run() -> None:
        edge = _fake_edge(tmp_path, **env)
        edge._ready_timeout_s = 1.0
        with pytest.raises(EdgeError, match=fragment):
            await edge.start()
        assert edge.pid is None

    asyncio.run(run())


def test_stop_kills_an_edge_that_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("router.edge_process.STOP_GRACE_S", 0.5)

    async def run() -> None:
        edge = _fake_edge(tmp_path, FAKE_EDGE_IGNORE_TERM="1")
        await edge.start()
        pid = edge.pid
        assert pid is not None
        await edge.stop()
        assert not pid_alive(pid)

    asyncio.run(run())


def _native_cluster_file(tmp_path: Path) -> Path:
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_cluster(data_plane="native")))
    return config


def test_router_without_an_edge_binary_says_what_to_do(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KVSERVE_EDGE_BIN": str(tmp_path / "no-such-binary"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "router", "-c", str(_native_cluster_file(tmp_path))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "router.data_plane is native but there is no kvserve-edge binary" in proc.stderr
    assert "scripts/setup.sh" in proc.stderr and "data_plane: python" in proc.stderr


def test_edge_dies_with_a_killed_router(tmp_path: Path) -> None:
    script = tmp_path / "fake_edge.py"
    script.write_text(_FAKE_EDGE)
    parent = textwrap.dedent(
        f"""\
        import asyncio, sys
        from router.edge_process import EdgeProcess
        async def main():
            edge = EdgeProcess([sys.executable, {str(script)!r}], {{}})
            await edge.start()
            print(edge.pid, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    router = subprocess.Popen(
        [sys.executable, "-c", parent],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.stdout is not None
        edge_pid = int(router.stdout.readline())
        assert pid_alive(edge_pid)
        router.kill()  # no chance to stop the edge itself
        router.wait()
        deadline = time.monotonic() + 10
        while pid_alive(edge_pid):
            assert time.monotonic() < deadline, "the edge outlived its router"
            time.sleep(0.05)
    finally:
        router.kill()


def _wait(what: str, ok: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ok():
                return
        except (httpx.HTTPError, psutil.Error):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _edge_children(router_pid: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(router_pid).children() if c.name() == "kvserve-edge"]


def _listening(pid: int) -> set[tuple[str, int]]:
    conns = psutil.Process(pid).net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def _complete(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 3},
        trust_env=False,
        timeout=30,
    )


def test_native_router_serves_through_the_edge(tmp_path: Path, edge_bin: Path) -> None:
    prefill = StandinWorker(tokens=[100, 101, 102])
    decode = StandinWorker(tokens=[100, 101, 102])
    servers = [ServerThread(prefill.app()), ServerThread(decode.app())]
    for s in servers:
        s.start()
    (port,) = free_ports(1)
    data = _cluster(data_plane="native", edge_threads=2, port=port)
    data["prefill"][0]["port"] = servers[0].port
    data["decode"][0]["port"] = servers[1].port
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVSERVE_EDGE_BIN": str(edge_bin)}
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "-c", str(config)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    edges: list[int] = []
    try:
        _wait("/health", lambda: httpx.get(url + "/health", trust_env=False).status_code == 200)
        (edge,) = _edge_children(proc.pid)
        edges.append(edge.pid)
        files = Path(edge.cmdline()[-1]).parent  # serve --config DIR/edge.json
        assert sorted(p.name for p in files.iterdir()) == [
            "chat_template.json",
            "control.sock",
            "edge.json",
            "tokenizer.json",
        ]
        # Who listens where: the edge on router.host:router.port only; the router on
        # loopback only, not on router.port.
        assert _listening(edge.pid) == {("127.0.0.1", port)}
        router_listens = _listening(proc.pid)
        assert router_listens and all(ip == "127.0.0.1" for ip, _ in router_listens)
        assert port not in {p for _, p in router_listens}

        models = httpx.get(url + "/v1/models", trust_env=False, timeout=10)  # proxied
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "smollm2-135m-instruct"
        r = _complete(url)  # served natively
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        chat = httpx.post(  # the template program was written: served natively
            url + "/v1/chat/completions",
            json={
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            trust_env=False,
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        bad = httpx.post(
            url + "/v1/completions",
            json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": -1},
            trust_env=False,
        )
        assert bad.status_code == 400  # proxied: the router's own answer
        assert "max_tokens" in bad.json()["error"]["message"]

        # The edge killed: the router starts another, which serves.
        os.kill(edge.pid, signal.SIGKILL)
        _wait(
            "a new edge",
            lambda: [e.pid for e in _edge_children(proc.pid)] not in ([], [edges[0]]),
            30,
        )
        _wait("/health again", lambda: _complete(url).status_code == 200, 30)
        (edge,) = _edge_children(proc.pid)
        edges.append(edge.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for s in servers:
            s.stop()
    _wait("no edge left", lambda: not any(pid_alive(e) for e in edges), 15)
    text = log.read_text()
    assert "exited with signal 9; starting it again" in text, text[-3000:]
    assert not files.exists()  # the edge's files went with it


def test_kvserve_up_and_down_with_the_native_data_plane(tmp_path: Path, edge_bin: Path) -> None:
    """`kvserve up` starts the router, the router the edge (its /health answers through
    the edge); `kvserve down` leaves neither, and the edge's exit is no crash to the
    router."""
    from test_launcher import Cluster

    c = Cluster(tmp_path)
    del c.commands["router"]  # the real `python -m router`
    text = c.config.read_text().replace(
        f"router: {{port: {c.router_port}}}",
        f"router: {{port: {c.router_port}, data_plane: native}}",
    )
    c.config.write_text(text)
    proc = c.driver(detach=True)
    edges: list[int] = []
    try:
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output
        st = c.state()
        assert st is not None
        (router_pid,) = [x["pid"] for x in st["components"] if x["name"] == "router"]
        edges = [e.pid for e in _edge_children(router_pid)]
        assert len(edges) == 1
        assert _listening(edges[0]) == {("127.0.0.1", c.router_port)}
        health = httpx.get(f"http://127.0.0.1:{c.router_port}/health", trust_env=False)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        res = c.cli("down")
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        c.cleanup(proc)
    _wait("nothing left", lambda: not any(pid_alive(p) for p in [router_pid, *edges]), 15)
    log = (c.state_dir / "standin" / "logs" / "router.log").read_text()
    assert "listening on" in log and "starting it again" not in log, log[-3000:]


def test_an_edge_that_cannot_bind_stops_the_router_with_its_reason(
    tmp_path: Path, edge_bin: Path
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = tmp_path / "cluster.yaml"
        config.write_text(yaml.safe_dump(_cluster(data_plane="native", port=port)))
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVSERVE_EDGE_BIN": str(edge_bin)}
        proc = subprocess.run(
            [sys.executable, "-m", "router", "-c", str(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "exited with code 1 before it listened" in proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr  # the edge's own message says what failed

"""Observability end to end: a live cluster (tiny random Llama, real prefill, decode, router
and pool) scraped by a real Prometheus (the Debian package's /usr/bin/prometheus, started
here on loopback with the config `kvserve render prometheus` prints), traffic, then every
query of every Grafana dashboard panel (deploy/grafana) must return data through
Prometheus' HTTP API. Also: the dashboards are what build_dashboards.py makes, with
unique uids and a templated datasource, and the example scrape config is current."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from cluster_harness import Cluster, free_ports, kvserve, start_cluster, wait_until

from kvserve.prometheus_config import render_prometheus
from protocol.cluster import load_cluster, parse_cluster

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))
SCRAPE_INTERVAL = "500ms"
RATE_WINDOW = "1m"
"""What `$__rate_interval` stands for here: the whole test's traffic fits in it."""
CLUSTER_NAME = "obs"


def prometheus_binary() -> str:
    """The Prometheus server binary; a clear failure (never a skip) when it is missing."""
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None
    )
    if found is None:
        pytest.fail(
            "the prometheus binary is not installed: run scripts/setup.sh "
            "(apt-get install prometheus), which CI runs before the tests"
        )
    return found


def dashboards() -> list[dict]:
    return [json.loads(p.read_text()) for p in DASHBOARD_FILES]


def panel_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard title, panel title, refId, expr) of every query of every panel."""
    return [
        (d["title"], p["title"], t["refId"], t["expr"])
        for d in dashboards()
        for p in d["panels"]
        for t in p["targets"]
    ]


# -- the dashboard files ----------------------------------------------------------------


def test_dashboards_are_current_output_of_the_builder():
    res = subprocess.run(
        [sys.executable, str(GRAFANA / "build_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    titles = {d["title"] for d in dashboards()}
    assert {
        "kvserve / Overview",
        "kvserve / KV reuse",
        "kvserve / Restore & handoff",
        "kvserve / Capacity",
    } <= titles


def test_dashboards_have_unique_uids_and_a_templated_datasource():
    boards = dashboards()
    uids = [d["uid"] for d in boards]
    assert len(set(uids)) == len(uids), uids
    for d in boards:
        variables = {v["name"]: v for v in d["templating"]["list"]}
        ds = variables.get("datasource")
        assert ds is not None and ds["type"] == "datasource" and ds["query"] == "prometheus"
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids), f"{d['uid']}: duplicate panel ids {ids}"
        for p in d["panels"]:
            assert p["datasource"]["uid"] == "${datasource}", (d["uid"], p["title"])
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(set(refs)) == len(refs), (d["uid"], p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", (d["uid"], p["title"])
                assert 'cluster=~"$cluster"' in t["expr"], (p["title"], t["expr"])
        cluster_var = variables["cluster"]
        assert cluster_var["datasource"]["uid"] == "${datasource}"


def test_grafana_provisioning_files():
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/kvserve.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and "${" in source["url"]
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/kvserve.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"


# -- kvserve render prometheus ----------------------------------------------------------


def _jobs(text: str) -> dict[str, list[dict]]:
    cfg = yaml.safe_load(text)
    return {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}


def test_render_prometheus_lists_every_component():
    cluster = parse_cluster(
        {
            "name": "two",
            "model": "builtin:smollm2-135m-instruct",
            "nodes": [{"name": "a", "host": "10.0.0.1"}, {"name": "b", "host": "10.0.0.2"}],
            "auth": {"secret_file": "/etc/kvserve/cluster_secret"},
            "pool": {
                "master": {"node": "a", "port": 50051, "metrics_port": 9003},
                "stores": [
                    {"node": "a", "size": "1GiB", "metrics_port": 9061},
                    {"node": "b", "size": "1GiB"},
                ],
            },
            "prefill": [
                {"name": "p0", "node": "a", "port": 8100, "devices": [0]},
                {"name": "p1", "node": "b", "port": 8100, "devices": [0], "metrics_port": 9100},
            ],
            "decode": [
                {"name": "d0", "node": "b", "port": 8200, "devices": [1, 2], "tensor_parallel": 2}
            ],
            "router": {"node": "a", "host": "0.0.0.0", "port": 8000, "api_key_env": "K"},
        }
    )
    jobs = _jobs(render_prometheus(cluster, scrape_interval="5s"))
    targets = {
        s["labels"]["instance"]: (job, s["targets"], s["labels"])
        for job, statics in jobs.items()
        for s in statics
    }
    assert targets["router"][:2] == ("kvserve-router", ["10.0.0.1:8000"])
    assert targets["p0"][:2] == ("kvserve-prefill", ["10.0.0.1:8100"])
    assert targets["p1"][:2] == ("kvserve-prefill", ["10.0.0.2:9100"])
    assert targets["d0"][:2] == ("kvserve-decode", ["10.0.0.2:8200"])
    assert targets["pool-master"][:2] == ("kvserve-pool-master", ["10.0.0.1:9003"])
    assert targets["pool-store-0"][:2] == ("kvserve-pool-store", ["10.0.0.1:9061"])
    assert "pool-store-1" not in targets  # no metrics_port: nothing to scrape
    assert targets["d0"][2] == {"instance": "d0", "role": "decode", "node": "b", "cluster": "two"}


def test_render_prometheus_scrapes_every_router_process():
    cluster = parse_cluster(
        {
            "name": "one",
            "model": "builtin:smollm2-135m-instruct",
            "nodes": [{"name": "a", "host": "10.0.0.1"}],
            "prefill": [{"name": "p0", "node": "a", "port": 8100, "devices": [0]}],
            "decode": [{"name": "d0", "node": "a", "port": 8200, "devices": [1]}],
            "router": {"node": "a", "port": 8000, "processes": 3, "metrics_port": 9010},
        }
    )
    jobs = _jobs(render_prometheus(cluster))
    statics = jobs["kvserve-router"]
    assert [s["targets"] for s in statics] == [
        ["10.0.0.1:9010"],
        ["10.0.0.1:9011"],
        ["10.0.0.1:9012"],
    ]
    assert [s["labels"]["process"] for s in statics] == ["0", "1", "2"]
    assert {s["labels"]["instance"] for s in statics} == {"router"}
    assert "process" not in jobs["kvserve-prefill"][0]["labels"]


def test_example_prometheus_config_is_current():
    example = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    want = render_prometheus(
        load_cluster(ROOT / "deploy" / "examples" / "local.yaml"), "deploy/examples/local.yaml"
    )
    assert example.read_text() == want, (
        "deploy/prometheus/prometheus.yml is stale: kvserve render prometheus "
        "-c deploy/examples/local.yaml > deploy/prometheus/prometheus.yml"
    )


# -- a live cluster and a real Prometheus -----------------------------------------------


class Prometheus:
    """A Prometheus server process on 127.0.0.1 with its storage in a temp dir."""

    def __init__(self, binary: str, config: Path, workdir: Path) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str) -> Iterator[tuple]:
    binary = prometheus_binary()
    tmp = tmp_path_factory.mktemp("obs")
    started = time.monotonic()
    (decode_metrics_port,) = free_ports(1)
    cluster = start_cluster(
        tmp,
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        name=CLUSTER_NAME,
        prefill={"pool_buffer_memory": "16MiB"},
        decode={"metrics_port": decode_metrics_port},  # a separate /metrics port, scraped
        pool=True,
    )
    prom = None
    try:
        res = kvserve(
            "render", "prometheus", "-c", str(cluster.config), "--scrape-interval", SCRAPE_INTERVAL
        )
        assert res.returncode == 0, res.stderr
        config = tmp / "prometheus.yml"
        config.write_text(res.stdout)
        prom = Prometheus(binary, config, tmp)
        assert wait_until(prom.ready, 30, 0.2), prom.log.read_text()
        yield cluster, prom, started
    finally:
        if prom is not None:
            prom.stop()
        res = cluster.down()
        assert res.returncode == 0, res.stderr


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    vocab = ["agent", "tool", "cache", "token", "block", "router", "decode", "prefill", "pool"]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def _complete(client: httpx.Client, served: str, prompt: str, **kw: object) -> int:
    body = {"model": served, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    body.update(kw)
    body.setdefault("ignore_eos", True)
    return client.post("/v1/completions", json=body).status_code


def _chat_stream(client: httpx.Client, served: str, content: str) -> int:
    body = {
        "model": served,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for _ in r.iter_bytes():
            pass
        return r.status_code


def drive_traffic(cluster: Cluster) -> int:
    """Three rounds ~2 scrapes apart (series born in one round grow in the next, so every
    rate has an increase to show): long prompts (> 2 pool chunks) computed, then restored
    from the pool after a prefix-cache reset, repeated for GPU hits; a streamed chat, a
    max_tokens=1 request, and rejected ones (bad JSON, prompt over the context).
    Returns the number of requests sent."""
    prompts = [_text(i, 130) for i in range(4)]  # ~780 tokens each (byte-level tokenizer)
    sent = 0
    with httpx.Client(base_url=cluster.router_url, timeout=60) as client:
        for rnd in range(3):
            new = prompts[rnd : rnd + 2]
            old = prompts[: rnd + 1] if rnd else []
            with ThreadPoolExecutor(2) as pool:
                codes = list(pool.map(lambda p: _complete(client, cluster.served_name, p), new))
            codes += [_complete(client, cluster.served_name, p) for p in old]  # pool restores
            codes.append(_complete(client, cluster.served_name, new[0]))  # GPU prefix hit
            codes.append(_chat_stream(client, cluster.served_name, _text(100 + rnd, 40)))
            codes.append(_complete(client, cluster.served_name, _text(200 + rnd, 20), max_tokens=1))
            assert codes == [200] * len(codes), codes
            bad_json = client.post(
                "/v1/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            )
            too_long = _complete(client, cluster.served_name, "x" * 5000)
            assert (bad_json.status_code, too_long) == (400, 400)
            sent += len(codes) + 2
            r = client.post("/v1/admin/reset_prefix_cache")
            assert r.status_code == 200, r.text
            time.sleep(1.1)  # two scrapes see this round before the next one starts
    return sent


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_every_dashboard_query_returns_data(live):
    cluster, prom, started = live
    want_up = {"router", "prefill-0", "decode-0", "pool-master", "pool-store-0"}

    def all_up() -> bool:
        up = {t["labels"]["instance"] for t in prom.targets() if t["health"] == "up"}
        return want_up <= up

    assert wait_until(all_up, 30, 0.5), json.dumps(prom.targets(), indent=1)
    sent = drive_traffic(cluster)
    total = f'sum(kvserve_router_requests_total{{cluster="{CLUSTER_NAME}"}})'
    assert wait_until(
        lambda: (r := prom.query(total)) != [] and float(r[0]["value"][1]) >= sent, 20, 0.5
    ), prom.query(total)

    queries = panel_queries()
    assert len(queries) > 40

    def missing() -> list[str]:
        out = []
        for board, panel, ref, expr in queries:
            q = expr.replace("$__rate_interval", RATE_WINDOW).replace("$cluster", CLUSTER_NAME)
            result = prom.query(q)
            if not _finite(result):
                out.append(f"{board} / {panel} / {ref}: {q}\n    -> {result}")
        return out

    deadline = time.monotonic() + 10  # the last scrapes may lag the traffic by a second
    while (failures := missing()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not failures, f"{len(failures)} of {len(queries)} panel queries returned no data:\n" + (
        "\n".join(failures)
    )
    elapsed = time.monotonic() - started
    print(f"{len(queries)} panel queries returned data; {elapsed:.1f}s from cluster start")

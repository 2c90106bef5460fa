"""`kvserve up` and the pool: what it plans (master, then stores, then workers), the
environment of pool processes (MC_TCP_BIND_ADDRESS), shared vs split pools, and the
restart of a pool process that dies while the cluster keeps serving (stand-ins)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import yaml
from test_launcher import STANDIN, Cluster, assert_all_gone, free_ports

from kvpool.topology import master_address
from kvserve.components import plan_components
from protocol.cluster import load_cluster

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "deploy" / "examples" / "local-pd.yaml"


def test_local_example_plans_pool_before_workers():
    cluster = load_cluster(LOCAL)
    stages = plan_components(cluster, LOCAL, ["local"])
    assert [[s.name for s in st] for st in stages] == [
        ["pool-master"],
        ["pool-store-0", "pool-store-1"],
        ["prefill-0", "decode-0", "router"],
    ]
    master, (s0, s1) = stages[0][0], stages[1]
    assert master.health_url == "http://127.0.0.1:9003/health" and master.restart
    assert s0.argv[-4:] == ("--index", "0", "--health-port", "9061") and s1.restart
    *workers, router = stages[2]  # the router starts beside the workers
    assert all(w.restart for w in workers)  # workers come back too; the router does not
    assert not router.restart
    assert router.waits_for == ("prefill-0", "decode-0") and not workers[0].waits_for
    for spec in (master, s0, s1):
        assert spec.env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
        assert spec.argv[1:3] == ("-m", "kvpool.master" if spec is master else "kvpool.store")


def test_several_router_processes_start_after_the_workers():
    """One router /health answers for one process only: with router.processes > 1 the
    router keeps a stage of its own, after the workers are healthy."""
    cluster = load_cluster(LOCAL)
    several = msgspec.structs.replace(
        cluster, router=msgspec.structs.replace(cluster.router, processes=2, metrics_port=9190)
    )
    stages = plan_components(several, LOCAL, ["local"])
    assert [[s.name for s in st] for st in stages][-2:] == [["prefill-0", "decode-0"], ["router"]]


def _split(tmp: Path, shared: bool) -> Path:
    ports = free_ports(8)
    cfg = {
        "name": "split",
        "model": "builtin:smollm2-135m-instruct",
        "nodes": [{"name": "a", "host": "127.0.0.1"}, {"name": "b", "host": "127.0.0.2"}],
        "pool": {
            "shared": shared,
            "master": {"node": "a", "port": ports[0], "metrics_port": ports[1]},
            "stores": [{"node": "a", "size": "16MiB"}, {"node": "b", "size": "16MiB"}],
        },
        "prefill": [
            {"name": "pa", "node": "a", "port": ports[2], "devices": ["cpu"]},
            {"name": "pb", "node": "b", "port": ports[3], "devices": ["cpu"]},
        ],
        "decode": [{"name": "d", "node": "a", "port": ports[4], "devices": ["cpu"]}],
    }
    path = tmp / f"split-{shared}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_split_pool_runs_a_master_per_node(tmp_path: Path):
    path = _split(tmp_path, shared=False)
    cluster = load_cluster(path)
    stages = plan_components(cluster, path, ["a", "b"])
    masters = stages[0]
    assert [(m.name, m.host) for m in masters] == [
        ("pool-master-a", "127.0.0.1"),
        ("pool-master-b", "127.0.0.2"),
    ]
    assert masters[1].env["MC_TCP_BIND_ADDRESS"] == "127.0.0.2"
    port = cluster.pool.master.port  # type: ignore[union-attr]
    assert master_address(cluster, "a") == f"127.0.0.1:{port}"
    assert master_address(cluster, "b") == f"127.0.0.2:{port}"
    shared = load_cluster(_split(tmp_path, shared=True))
    assert [m.name for m in plan_components(shared, path, ["a", "b"])[0]] == ["pool-master"]
    assert master_address(shared, "b") == f"127.0.0.1:{shared.pool.master.port}"  # type: ignore[union-attr]
    # Only this host's part is planned when one node is selected.
    assert [s.name for s in plan_components(cluster, path, ["b"])[0]] == ["pool-master-b"]


def test_a_dead_pool_process_is_restarted_while_the_cluster_serves(tmp_path: Path):
    c = Cluster(tmp_path, modes={"pool-store-0": "die_after:0.5"})
    data = yaml.safe_load(c.config.read_text())
    mport, mmetrics = free_ports(2)
    data["pool"] = {
        "master": {"node": "local", "port": mport, "metrics_port": mmetrics},
        "stores": [{"node": "local", "size": "16MiB"}],
    }
    c.config.write_text(yaml.safe_dump(data))
    (tmp_path / "standin.py").write_text(STANDIN)
    c.commands.update(pool_master=c.commands["router"], pool_store=c.commands["router"])
    proc = c.driver()
    try:
        st = c.wait_phase("running")
        first = {x["name"]: x["pid"] for x in st["components"]}
        assert list(first)[:2] == ["pool-master", "pool-store-0"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = c.state() or {}
            now = {x["name"]: x["pid"] for x in st.get("components", [])}
            if now.get("pool-store-0") not in (None, first["pool-store-0"]):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("pool-store-0 was not restarted")
        assert st["phase"] == "running" and proc.poll() is None  # the cluster kept running
        assert now["router"] == first["router"] and now["prefill-0"] == first["prefill-0"]
        res = c.cli("down")
        output, _ = proc.communicate(timeout=30)
    finally:
        c.cleanup(proc)
    assert res.returncode == 0 and proc.returncode == 0, output
    assert "pool-store-0 exited with code 4; restarting it in 1s" in output
    assert "restarted pool-store-0" in output
    assert_all_gone(c, ["router", "prefill-0", "decode-0", "pool-master"])

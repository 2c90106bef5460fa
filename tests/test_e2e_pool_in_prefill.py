"""End to end with the pool's only segment mounted in a prefill instance
(`pool.stores[0].prefill: prefill-0`): `kvserve up` starts a master and no store service;
prefill-0 contributes the pool's memory, prefill-1 is a pure client. A session restores
its history from the pool on either instance (prefill-1 reads prefill-0's segment) and
matches a cold recompute; killing prefill-0 with SIGKILL takes the pool's memory with it,
and every request still succeeds, with the same output, recomputed on prefill-1; once
the launcher has restarted prefill-0, its new segment serves the pool again. prefill-0
reads the objects in its own segment in place (kvpool/client.py), prefill-1 copies them."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from cluster_harness import free_ports, kvserve, wait_until
from test_e2e_pool import (
    CHUNK,
    PoolCluster,
    Session,
    _kill,
    reference,  # noqa: F401 (fixture)
)

pytestmark = pytest.mark.timeout(600)
SEGMENT = 48 << 20
FAILURES = "kvserve_pool_failures_total"


def _config(tmp: Path, model: str, cache_dir: str) -> tuple[Path, dict]:
    p = free_ports(8)
    prefill = {
        "node": "n0",
        "devices": ["cpu"],
        "max_batched_tokens": 512,
        "max_num_seqs": 16,
        "kv_cache_memory": "32MiB",
        "pool_buffer_memory": "8MiB",
    }
    cfg = {
        "name": "e2e-pool-in-prefill",
        "model": model,
        "dtype": "float32",
        "cache": {"block_size": 16, "chunk_size": CHUNK, "weights_cache_dir": cache_dir},
        "nodes": [{"name": "n0", "host": "127.0.0.1"}],
        "pool": {
            "master": {"node": "n0", "port": p[1], "metrics_port": p[2], "client_ttl_s": 3},
            "stores": [{"node": "n0", "size": SEGMENT, "prefill": "prefill-0"}],
        },
        "prefill": [
            {"name": "prefill-0", "port": p[3], **prefill},
            {"name": "prefill-1", "port": p[4], **prefill},
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "n0",
                "port": p[5],
                "devices": ["cpu"],
                "kv_cache_memory": "32MiB",
                "landing_memory": "16MiB",
            }
        ],
        "router": {
            "host": "127.0.0.1",
            "port": p[0],
            "policy": "round_robin",
            "served_model_name": "e2e-model",
            "request_timeout_s": 60,
        },
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str):
    tmp = tmp_path_factory.mktemp("inprefill")
    path, cfg = _config(tmp, str(tiny_llama_dir), weights_cache_dir)
    state = tmp / "state"
    res = kvserve("up", "-c", str(path), "--detach", "--state-dir", str(state))
    assert res.returncode == 0, f"kvserve up failed:\n{res.stdout}\n{res.stderr}"
    c = PoolCluster(
        path,
        state,
        f"http://127.0.0.1:{cfg['router']['port']}",
        "",
        "",
        "e2e-model",
        cfg["name"],
        f"http://127.0.0.1:{cfg['pool']['master']['metrics_port']}",
    )
    c.cfg = cfg
    yield c
    res = c.down()
    assert res.returncode == 0, res.stderr


def _capacity(c: PoolCluster) -> int:
    text = httpx.get(c.pool_metrics_url + "/metrics", timeout=5).text  # type: ignore[operator]
    m = re.search(r"^master_total_capacity_bytes (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def _segments(c: PoolCluster) -> list[str]:
    url = c.pool_metrics_url + "/get_segments_detail"  # type: ignore[operator]
    return [s["segment_name"] for s in httpx.get(url, timeout=5).json()["segments"]]


def test_prefill_mounts_the_pool_and_no_store_service_runs(cluster: PoolCluster):
    pids = cluster.pids()
    assert not [n for n in pids if n.startswith("pool-store")], pids
    assert {"pool-master", "prefill-0", "prefill-1"} <= set(pids)
    assert _capacity(cluster) == SEGMENT  # prefill-0's segment, the whole pool
    env = Path(f"/proc/{pids['prefill-0']}/environ").read_bytes().split(b"\0")
    assert b"MC_TCP_BIND_ADDRESS=127.0.0.1" in env
    res = kvserve("status", "-c", str(cluster.config), "--state-dir", str(cluster.state_dir))
    assert res.returncode == 0 and "pool-store" not in res.stdout, res.stdout


def test_both_instances_restore_from_the_segment_in_prefill_0(cluster: PoolCluster, reference):  # noqa: F811
    s = Session(21, reference)
    before = cluster.pool_tokens()
    s.turn(cluster, 0)
    for k in range(1, 5):  # round robin: turns alternate between the two instances
        cluster.reset()
        _, details, _ = s.turn(cluster, k)  # asserts the output equals a cold recompute
        assert details["gpu_tokens"] == 0 and details["pool_tokens"] > 0, (k, details)
    gained = [a - b for a, b in zip(cluster.pool_tokens(), before, strict=True)]
    assert all(g > 0 for g in gained), f"restored tokens per instance: {gained}"
    # prefill-0 read its own segment's objects in place (no copy into its load slots);
    # prefill-1, a pure client, read them over the transport. Outputs matched either way.
    in_place = [
        cluster.metric(u, "kvserve_pool_load_in_place_objects_total")
        for u in cluster.prefill_urls()
    ]
    assert in_place[0] > 0 and in_place[1] == 0, in_place


def test_killed_prefill_takes_its_segment_and_requests_still_succeed(
    cluster: PoolCluster,
    reference,  # noqa: F811
):
    sessions = [Session(30 + i, reference) for i in range(3)]
    for s in sessions:
        s.turn(cluster, 0)  # saved into prefill-0's segment, whichever instance ran it
    cluster.reset()
    (segment,) = _segments(cluster)  # prefill-0's, the only one
    old = _kill(cluster, "prefill-0")
    # Every turn now runs on prefill-1 (the router routes around the dead instance): the
    # history's objects are gone with prefill-0, so it is recomputed, with the same output
    # (Session.turn asserts it) and no error.
    restored = [s.turn(cluster, 1)[1]["pool_tokens"] for s in sessions]
    p1 = cluster.prefill_urls()[1]
    print(
        "after the prefill kill: prefill-1 load failures", cluster.metric(p1, FAILURES, op="load")
    )
    assert restored == [0, 0, 0], restored
    # client_ttl later the master has dropped the dead segment (the restarted prefill-0
    # may have mounted its new one already).
    assert wait_until(lambda: segment not in _segments(cluster), timeout_s=30, interval_s=0.2)

    def back() -> bool:
        try:
            pid = cluster.pids()["prefill-0"]
            url = f"http://127.0.0.1:{cluster.cfg['prefill'][0]['port']}/health"
            return pid != old and httpx.get(url, timeout=1).status_code == 200
        except (httpx.HTTPError, KeyError, OSError):
            return False

    assert wait_until(back, timeout_s=120, interval_s=0.5), "prefill-0 did not come back"
    assert wait_until(lambda: _capacity(cluster) == SEGMENT, timeout_s=30, interval_s=0.2)
    assert len(_segments(cluster)) == 1 and segment not in _segments(cluster)
    # Pooling resumes on the new segment: a new session is saved, then restored.
    s = Session(99, reference)
    deadline = time.monotonic() + 60
    while True:
        s.turn(cluster, 0)
        cluster.reset()
        _, details, _ = s.turn(cluster, 1)
        if details["pool_tokens"] > 0:
            break
        assert time.monotonic() < deadline, "pooling did not resume"
        s = Session(int(time.monotonic() * 1000) % 10_000 + 100, reference)
        time.sleep(1)

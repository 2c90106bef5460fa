"""A pool store mounted in a prefill process (`pool.stores[].prefill`): the cluster checks,
the launch plan (no store process for it), and, on a real Mooncake master and store
service over loopback, the segment itself: a client with a segment puts its objects
there, reads them back exactly, every other client reads them too (one shared pool), and
when the owning process is killed its objects fail per key, like a dead store's, while
the rest of the pool keeps serving."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from cluster_harness import free_ports
from pool_harness import Pool, pool_cluster_dict, spawn, start_pool

from kvpool.backend import BackendConfig, PoolBackend, create_backend
from kvpool.errors import KeyStatus
from kvpool.topology import prefill_segment
from kvserve.components import plan_components
from protocol.cluster import load_cluster
from protocol.config_errors import ConfigError

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20
OBJ = 1 * MiB
N = 6


def _cluster(tmp: Path, stores: list[dict], pp: int = 1) -> Path:
    ports = free_ports(6)
    cfg = pool_cluster_dict(ports)
    cfg["pool"]["stores"] = stores
    cfg["prefill"][0]["devices"] = ["cpu"] * pp
    cfg["prefill"][0]["pipeline_parallel"] = pp
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("store", "pp", "key", "says"),
    [
        ({"prefill": "nope"}, 1, "pool.stores[1].prefill", "no prefill instance 'nope'"),
        ({"prefill": "p", "numa_node": 0}, 1, "pool.stores[1].numa_node", "does not apply"),
        ({"prefill": "p", "metrics_port": 9999}, 1, "pool.stores[1].metrics_port", "remove"),
        ({"prefill": "p", "size": "40MiB"}, 4, "pool.stores[1].size", "below 16MiB"),
    ],
)
def test_store_in_prefill_checks(tmp_path: Path, store: dict, pp: int, key: str, says: str):
    stores = [{"node": "local", "size": "64MiB"}, {"node": "local", "size": "64MiB", **store}]
    with pytest.raises(ConfigError) as e:
        load_cluster(_cluster(tmp_path, stores, pp))
    assert e.value.path == key and says in str(e.value), str(e.value)


def test_one_store_per_prefill_on_its_node(tmp_path: Path):
    two = [{"node": "local", "size": "32MiB", "prefill": "p"}] * 2
    with pytest.raises(ConfigError, match="already mounted in prefill 'p'"):
        load_cluster(_cluster(tmp_path, two))
    cfg = yaml.safe_load(_cluster(tmp_path, two[:1]).read_text())
    cfg["nodes"].append({"name": "other", "host": "127.0.0.2"})
    cfg["pool"]["stores"][0]["node"] = "other"
    (tmp_path / "c2.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="runs on node local, not other"):
        load_cluster(tmp_path / "c2.yaml")


def test_plan_has_no_process_for_it_and_stages_split_its_size(tmp_path: Path):
    stores = [
        {"node": "local", "size": "64MiB", "prefill": "p", "hugepages": True},
        {"node": "local", "size": "32MiB"},
    ]
    path = _cluster(tmp_path, stores, pp=2)
    cluster = load_cluster(path)
    names = [[s.name for s in st] for st in plan_components(cluster, path, ["local"])]
    assert names == [["pool-master"], ["pool-store-1"], ["p", "d", "router"]]
    assert prefill_segment(cluster, "p") == (32 * MiB, True)  # 64 MiB over 2 stages
    assert prefill_segment(cluster, "d") == (0, False)


# -- the segment on a real pool -----------------------------------------------------------

OWNER = textwrap.dedent(
    """
    import json, sys, time, torch
    from kvpool.backend import BackendConfig, create_backend
    master, n, size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    b = create_backend("mooncake", BackendConfig("127.0.0.1", master, segment_bytes=32 << 20))
    buf = torch.zeros(2 * n * size, dtype=torch.uint8)
    b.register_buffer(buf.data_ptr(), buf.numel())
    g = torch.Generator().manual_seed(7)
    buf[: n * size] = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    keys = [f"own/{i}" for i in range(n)]
    ptrs = [buf.data_ptr() + i * size for i in range(n)]
    assert all(s.value == "ok" for s in b.put_from(keys, ptrs, [size] * n, ["own"] * n))
    got = b.get_into(keys, [p + n * size for p in ptrs], [size] * n)
    exact = got == [size] * n and torch.equal(buf[: n * size], buf[n * size :])
    json.dump({"segment": b.segment, "exact": exact}, open(out + ".tmp", "w"))
    import os; os.rename(out + ".tmp", out)
    time.sleep(3600)
    """
)


def _expected() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (N * OBJ,), dtype=torch.uint8, generator=g)


def _segments(pool: Pool) -> dict[str, int]:
    detail = httpx.get(pool.metrics_url + "/get_segments_detail", timeout=5).json()
    return {s["segment_name"]: int(s["allocator_used_bytes"]) for s in detail["segments"]}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = start_pool(tmp_path_factory.mktemp("inprefill"), store_sizes=("32MiB",), client_ttl_s=2)
    yield p
    p.stop()


@pytest.fixture
def reader(pool: Pool) -> Iterator[tuple[PoolBackend, torch.Tensor]]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    b = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
    buf = torch.zeros(2 * N * OBJ, dtype=torch.uint8)
    b.register_buffer(buf.data_ptr(), buf.numel())
    yield b, buf
    b.unregister_buffer(buf.data_ptr())
    b.close()


def test_segment_in_a_process_is_the_pools_and_dies_like_a_store(
    pool: Pool, reader: tuple[PoolBackend, torch.Tensor], tmp_path: Path
):
    b, buf = reader
    base = buf.data_ptr()
    # The reader's own objects, written while the store service is the only segment.
    buf[: N * OBJ] = torch.arange(N * OBJ, dtype=torch.int64).to(torch.uint8)
    mine = [f"mine/{i}" for i in range(N)]
    assert (
        b.put_from(mine, [base + i * OBJ for i in range(N)], [OBJ] * N, [""] * N)
        == [KeyStatus.OK] * N
    )
    before = _segments(pool)
    assert len(before) == 1

    out = tmp_path / "owner.json"
    argv = [sys.executable, "-c", OWNER, pool.master_address, str(N), str(OBJ), str(out)]
    spawn(pool, "owner", argv)
    deadline = time.monotonic() + 60
    while not out.exists():
        assert pool.procs["owner"].poll() is None, "the owner exited (see its log)"
        assert time.monotonic() < deadline, "the owner did not get ready"
        time.sleep(0.1)
    owner = json.loads(out.read_text())
    assert owner["exact"], "the owner's read of its own objects differs"
    # Every object the owner wrote sits in its own segment, none in the store service.
    used = _segments(pool)
    assert used[owner["segment"]] >= N * OBJ
    assert {k: v for k, v in used.items() if k != owner["segment"]} == before

    # Another process reads them over the transport, byte for byte: one shared pool.
    own = [f"own/{i}" for i in range(N)]
    dst = [base + N * OBJ + i * OBJ for i in range(N)]
    buf[N * OBJ :].zero_()
    assert b.get_into(own, dst, [OBJ] * N) == [OBJ] * N
    assert torch.equal(buf[N * OBJ :], _expected())

    # The owner dies: its objects fail per key (never a raise), the rest still serve.
    os.kill(pool.procs["owner"].pid, signal.SIGKILL)
    pool.procs["owner"].wait(timeout=10)
    got = b.get_into(own, dst, [OBJ] * N)
    assert all(isinstance(g, KeyStatus) for g in got), got
    assert set(got) <= {KeyStatus.TRANSFER_FAILED, KeyStatus.MISSING}, got
    assert b.get_into(mine, dst, [OBJ] * N) == [OBJ] * N
    # After client_ttl the master drops the segment: its objects no longer exist.
    deadline = time.monotonic() + 30
    while any(b.exists(own)):
        assert time.monotonic() < deadline, "the dead owner's objects never left the pool"
        time.sleep(0.2)
    assert owner["segment"] not in _segments(pool)
    assert all(b.exists(mine))


def test_every_stage_process_of_a_pp_prefill_puts_into_its_own_segment(pool: Pool, tmp_path: Path):
    """The connector hook (build_pool_client) as each stage process of a PP 2 prefill calls
    it: a segment of size / 2 per stage, each stage's objects in its own segment; a
    graceful close unmounts it at once."""
    from kvpool.stats import StageCounters
    from prefill_worker.pool_connector import build_pool_client
    from protocol.ids import ChunkKey
    from protocol.kv_layout import KVLayout
    from protocol.namespace import KVNamespace

    cfg = yaml.safe_load(pool.config.read_text())
    cfg["pool"]["stores"].append({"node": "local", "size": "32MiB", "prefill": "p"})
    cfg["prefill"][0].update(devices=["cpu", "cpu"], pipeline_parallel=2)
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cluster = load_cluster(path)
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    ns = KVNamespace(
        weights_fingerprint="inprefill",
        kv_dtype="float32",
        block_size=16,
        layer_split=(2, 2),
        rope="-",
    )
    before = _segments(pool)
    clients = [
        build_pool_client(
            cluster, cluster.prefill[0], ns, layout, StageCounters(), stage, torch.device("cpu")
        )
        for stage in (0, 1)
    ]
    try:
        segs = [c.backend.segment for c in clients]  # type: ignore[attr-defined]
        assert None not in segs and len(set(segs)) == 2
        detail = httpx.get(pool.metrics_url + "/get_segments_detail", timeout=5).json()
        sizes = {s["segment_name"]: int(s["size_bytes"]) for s in detail["segments"]}
        assert [sizes[s] for s in segs] == [16 * MiB, 16 * MiB]
        keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
        for stage, c in enumerate(clients):
            slots = c.buffer.save_slot_ids[:3]
            assert c.write(stage, keys, slots) == [True] * 3
        used = _segments(pool)
        obj = clients[0].specs[0].object_bytes
        assert all(used[s] >= 3 * obj for s in segs), used
        assert {k: v for k, v in used.items() if k not in segs} == before
    finally:
        for c in clients:
            c.close()
    assert set(_segments(pool)) == set(before)  # unmounted at close, not after client_ttl

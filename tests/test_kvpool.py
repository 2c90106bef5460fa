"""kvpool without an engine: the object format, one conformance suite for every pool
backend, the hit rule across stages, damaged objects (caught, removed, counted), other
namespaces, the group invariant under forced eviction on a real Mooncake pool (master +
two store services over tcp on loopback), and the pool's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from cluster_harness import free_ports
from pool_harness import Pool, listening_sockets, pool_cluster_dict, start_pool, store_argv
from prometheus_client import CollectorRegistry

from kvpool.backend import BackendConfig, NoneBackend, PoolBackend, create_backend
from kvpool.buffer import SlotBuffer
from kvpool.client import PoolClient
from kvpool.errors import KeyStatus, PoolConfigError
from kvpool.master import master_argv
from kvpool.metrics import PoolMetrics
from kvpool.object_format import (
    check_object,
    payload_checksum,
    payload_checksum_t,
    payload_sums_t,
    stored_payload_checksum,
    write_header,
)
from kvpool.topology import master_address, numa_plan
from protocol.cluster import load_cluster
from protocol.ids import ChunkKey
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace

pytestmark = pytest.mark.timeout(180)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


def _ns(split: tuple[int, ...] = (1, 1, 1, 1), weights: str = "w0", dtype: str = "float32"):
    return KVNamespace(
        weights_fingerprint=weights, kv_dtype=dtype, block_size=16, layer_split=split, rope="r"
    )


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(4, "little") * 4)


def _client(backend: PoolBackend, ns: KVNamespace | None = None, **kw) -> PoolClient:
    metrics = PoolMetrics(CollectorRegistry(), "test")
    return PoolClient(
        backend,
        ns or _ns(),
        LAYOUT,
        buffer_bytes=kw.pop("buffer_bytes", 4 << 20),
        max_save_chunks=kw.pop("max_save_chunks", 8),
        metrics=metrics,
        **kw,
    )


def _another(backend: PoolBackend) -> PoolBackend:
    """A second client of the same pool (as another process would be)."""
    return create_backend(backend.name, backend.config)  # type: ignore[attr-defined]


def _value(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


def _fill_and_write(client: PoolClient, keys: list[ChunkKey], seed: int = 0) -> int:
    """Random payloads for every stage of `keys`, saved; returns the chunks stored."""
    g = torch.Generator().manual_seed(seed)
    n = len(client.local_stages)
    ids = client.buffer.save_slot_ids[: len(keys) * n]
    slots = [ids[c * n : (c + 1) * n] for c in range(len(keys))]
    for chunk_slots in slots:
        for stage, s in zip(client.local_stages, chunk_slots, strict=True):
            spec = client.specs[stage.index]
            client.buffer.payload(s, spec).copy_(torch.randn(spec.shape, generator=g))
    return len(client.save_chunks(keys, slots))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    p = start_pool(tmp_path_factory.mktemp("pool"), store_sizes=("16MiB", "16MiB"))
    yield p
    p.stop()


_local_ids = iter(range(10**6))


@pytest.fixture(params=["local", "mooncake"])
def backend(request: pytest.FixtureRequest) -> Iterator[PoolBackend]:
    if request.param == "local":
        b = create_backend("local", BackendConfig("127.0.0.1", f"local-{next(_local_ids)}"))
    else:
        pool = request.getfixturevalue("pool")
        b = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
    yield b
    b.close()


# -- object format --------------------------------------------------------------------


def test_object_header_and_checksum_catch_every_difference():
    client = _client(NoneBackend())
    spec = client.specs[2]
    obj = client.buffer.object(0)
    client.buffer.payload(0, spec).normal_()
    write_header(obj, spec, _key(7))
    n = spec.object_bytes
    assert check_object(obj, n, spec, _key(7)) is None
    assert check_object(obj, n - 1, spec, _key(7)) == "size"
    assert check_object(obj, n, spec, _key(8)) == "chunk_key"
    assert check_object(obj, n, client.specs[1], _key(7)) == "layout"
    other = _client(NoneBackend(), _ns(weights="w1")).specs[2]
    assert check_object(obj, n, other, _key(7)) == "namespace"
    obj[n - 1] ^= 0xFF
    assert check_object(obj, n, spec, _key(7)) == "checksum"
    obj[n - 1] ^= 0xFF
    obj[40] ^= 0x01  # inside the header: its own checksum catches it
    assert check_object(obj, n, spec, _key(7)) == "header"


def test_payload_checksum_detects_flips_swaps_and_zeroed_ranges():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8, generator=g)
    ref = payload_checksum_t(base)
    assert ref == payload_checksum_t(base.clone())  # deterministic
    for byte in (0, 1, 4097, base.numel() - 1):  # single-bit flips, every bit position
        for bit in range(8):
            x = base.clone()
            x[byte] ^= 1 << bit
            assert payload_checksum_t(x) != ref, (byte, bit)
    words = base.view(torch.int32)
    for i, j in ((0, 1), (5, 9000), (100, words.numel() - 1)):  # swapped int32 words
        x = words.clone()
        assert x[i] != x[j]
        x[i], x[j] = words[j].clone(), words[i].clone()
        assert payload_checksum_t(x.view(torch.uint8)) != ref, (i, j)
    # swapped words whose difference is a large power of two (s1 unchanged, s2 must see it)
    x = torch.zeros(1024, dtype=torch.int32)
    x[3] = -(2**31)
    y = x.clone()
    y[3], y[700] = 0, -(2**31)
    assert payload_checksum_t(x.view(torch.uint8)) != payload_checksum_t(y.view(torch.uint8))
    for lo, hi in ((0, 4096), (1000, 1003), (30000, 65536)):  # zeroed ranges
        x = base.clone()
        x[lo:hi] = 0
        assert payload_checksum_t(x) != ref, (lo, hi)
    # a length that is not a multiple of 4: zero padded, trailing byte still covered
    odd = base[:4099].clone()
    flipped = odd.clone()
    flipped[-1] ^= 1
    assert payload_checksum_t(odd) != payload_checksum_t(flipped)


def test_payload_checksum_same_on_every_view_and_device():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 256, 4, 8, generator=g).to(torch.bfloat16)
    flat = kv.reshape(-1).view(torch.uint8)
    ref = payload_checksum_t(flat)
    assert payload_checksum_t(kv.view(torch.uint8)) == ref  # [..., 2*D] bytes view: flattened
    assert payload_checksum_t(torch.from_numpy(flat.numpy().copy())) == ref  # numpy path
    # a non-contiguous uint8 view of the same bytes (made contiguous inside)
    strided = torch.empty(flat.numel() * 2, dtype=torch.uint8)[::2]
    strided.copy_(flat)
    assert not strided.is_contiguous()
    assert payload_checksum_t(strided) == ref
    # batched sums == per-payload sums
    two = torch.stack((flat, flat.flip(0)))
    sums = payload_sums_t(two)
    assert sums[0].tolist() == payload_sums_t(flat).tolist()
    assert sums[1].tolist() == payload_sums_t(flat.flip(0)).tolist()
    # int64 wraparound: all-ones words overflow the products, still order independent
    big = torch.full((1 << 16,), -1, dtype=torch.int32).view(torch.uint8)
    assert payload_checksum_t(big) == payload_checksum_t(big.clone())
    if torch.cuda.is_available():
        assert payload_checksum_t(flat.cuda()) == ref
        assert payload_checksum_t(big.cuda()) == payload_checksum_t(big)
        assert payload_sums_t(two.cuda()).cpu().tolist() == sums.tolist()


def test_header_takes_a_checksum_computed_elsewhere():
    client = _client(NoneBackend())
    spec = client.specs[0]
    obj = client.buffer.object(0)
    pay = client.buffer.payload(0, spec)
    pay.normal_()
    cks = payload_checksum_t(pay.reshape(-1).view(torch.uint8))
    assert cks == payload_checksum(obj, spec)
    write_header(obj, spec, _key(3), cks)
    assert stored_payload_checksum(obj) == cks
    assert check_object(obj, spec.object_bytes, spec, _key(3)) is None
    obj[spec.object_bytes - 1] ^= 0x10
    assert check_object(obj, spec.object_bytes, spec, _key(3)) == "checksum"
    # the caller verifies the payload itself: only size and header here
    assert check_object(obj, spec.object_bytes, spec, _key(3), verify_payload=False) is None
    write_header(obj, spec, _key(3), cks ^ 1)  # a wrong value given by the caller
    assert check_object(obj, spec.object_bytes, spec, _key(3)) == "checksum"


def test_buffer_too_small_says_how_much_is_needed():
    with pytest.raises(PoolConfigError, match="raise pool_buffer_memory"):
        _client(NoneBackend(), buffer_bytes=100_000)


# -- backend conformance ----------------------------------------------------------------


def test_backend_put_get_exists_remove(backend: PoolBackend):
    buf = SlotBuffer(backend, 4096, 8, 4)
    try:
        for i in range(4):
            buf.object(i)[:] = i + 1
        keys = [f"conf/{id(buf)}/{i}" for i in range(4)]
        ptrs = [buf.ptr(i) for i in range(4)]
        groups = ["g0", "g0", "g1", ""]
        assert backend.put_from(keys, ptrs, [4096] * 4, groups) == [KeyStatus.OK] * 4
        assert backend.exists([*keys, "conf/nope"]) == [True] * 4 + [False]
        got = backend.get_into(keys, [buf.ptr(4 + i) for i in range(4)], [4096] * 4)
        assert got == [4096] * 4
        for i in range(4):
            assert (buf.object(4 + i) == i + 1).all()
        # An existing key is not overwritten; the first writer wins.
        buf.object(0)[:] = 99
        assert backend.put_from(keys[:1], ptrs[:1], [4096], ["g0"]) == [KeyStatus.OK]
        assert backend.get_into(keys[:1], [buf.ptr(5)], [4096]) == [4096]
        assert (buf.object(5) == 1).all()
        # Too little room: nothing is copied, the answer says why.
        buf.object(6)[:] = 7
        assert backend.get_into(keys[1:2], [buf.ptr(6)], [100]) == [KeyStatus.INVALID]
        assert (buf.object(6) == 7).all()
        assert backend.remove(keys[:2]) == [KeyStatus.OK] * 2
        assert backend.remove(keys[:1]) == [KeyStatus.MISSING]
        assert backend.exists(keys) == [False, False, True, True]
        assert backend.get_into(keys[:1], [buf.ptr(7)], [4096]) == [KeyStatus.MISSING]
        backend.remove(keys[2:])
    finally:
        buf.close()


def test_none_backend_finds_nothing_and_discards_writes():
    b = NoneBackend()
    assert b.exists(["a", "b"]) == [False, False]
    assert b.put_from(["a"], [0], [1], [""]) == [KeyStatus.OK]
    assert b.exists(["a"]) == [False]
    assert b.get_into(["a"], [0], [1]) == [KeyStatus.MISSING]


# -- the client: hit rule, damaged objects, namespaces ----------------------------------------


def test_hit_rule_is_min_over_stages_of_leading_runs(backend: PoolBackend):
    client = _client(backend, _ns(weights=f"hit-{id(backend)}"))
    keys = [_key(100 + i) for i in range(4)]
    assert _fill_and_write(client, keys) == 4
    assert client.lookup(keys) == 4
    client.backend.remove([client.keys.object_key(keys[2], 1)])  # stage 1 loses chunk 2
    assert client.lookup(keys) == 2
    assert client.lookup(keys[:2]) == 2
    slots = client.buffer.load_slot_ids[:4]
    assert client.read(0, keys, slots) == 4  # stage 0 has all four
    assert client.read(1, keys, slots) == 2
    assert _value(client.metrics.hit_chunks) == 4 + 2 + 2
    assert _value(client.metrics.failures, instance="test", op="load", reason="missing") == 1
    client.close()


def test_tampered_object_is_caught_removed_and_counted(backend: PoolBackend):
    client = _client(backend, _ns(weights=f"tamper-{id(backend)}"))
    keys = [_key(200 + i) for i in range(3)]
    _fill_and_write(client, keys)
    # Flip one payload byte of chunk 1, stage 3, and put it back under its key and group.
    victim = client.keys.object_key(keys[1], 3)
    slot = client.buffer.load_slot_ids[0]
    n = client.specs[3].object_bytes
    assert backend.get_into([victim], [client.buffer.ptr(slot)], [client.buffer.slot_bytes]) == [n]
    client.buffer.object(slot)[n - 10] ^= 0x40
    backend.remove([victim])
    group = client.keys.group_id(keys[1])
    assert backend.put_from([victim], [client.buffer.ptr(slot)], [n], [group]) == [KeyStatus.OK]
    assert client.lookup(keys) == 3  # existence cannot tell
    assert client.read(3, keys, client.buffer.load_slot_ids[:3]) == 1
    assert _value(client.metrics.checksum_failures) == 1
    assert _value(client.metrics.failures, instance="test", op="load", reason="checksum") == 1
    assert backend.exists([victim]) == [False]  # removed at once
    assert client.lookup(keys) == 1
    client.close()


def test_other_namespace_never_reads_our_objects(backend: PoolBackend):
    tag = f"ns-{id(backend)}"
    ours = _client(backend, _ns(weights=tag))
    keys = [_key(300 + i) for i in range(2)]
    _fill_and_write(ours, keys)
    for other_ns in (_ns(weights=tag + "-other"), _ns(weights=tag, dtype="bfloat16")):
        other = _client(_another(backend), other_ns)
        assert other.lookup(keys) == 0  # other keys altogether
        # Even an object copied under the other namespace's key is refused by its header.
        slot = other.buffer.load_slot_ids[0]
        n = ours.specs[0].object_bytes
        other.backend.get_into(
            [ours.keys.object_key(keys[0], 0)], [other.buffer.ptr(slot)], [other.buffer.slot_bytes]
        )
        stolen = other.keys.object_key(keys[0], 0)
        other.backend.put_from([stolen], [other.buffer.ptr(slot)], [n], [""])
        assert other.read(0, keys[:1], [other.buffer.load_slot_ids[1]]) == 0
        assert _value(other.metrics.checksum_failures) == 1
        other.close()
    assert ours.lookup(keys) == 2
    ours.close()


# -- the group invariant under forced eviction (real Mooncake) --------------------------------


def test_forced_eviction_takes_chunks_whole(pool: Pool):
    """2 x 16 MiB of stores, 4 stages x 64 KiB objects, ~3x the pool written stage by
    stage: eviction must leave (almost) no chunk that only some stages hold, and a chunk
    is restorable only when every stage's object verifies."""
    backend = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
    client = _client(backend, _ns(weights="evict"), buffer_bytes=12 << 20, max_save_chunks=16)
    num_chunks = 3 * pool.capacity_bytes // (4 * client.specs[0].object_bytes)
    keys = [_key(10_000 + i) for i in range(num_chunks)]
    for i in range(0, num_chunks, 16):
        _fill_and_write(client, keys[i : i + 16], seed=i)  # failures allowed: degrade
    assert pool.master_metric("master_successful_evictions_total") > 0
    stage_keys = [[client.keys.object_key(k, s) for k in keys] for s in range(4)]
    present = [backend.exists(sk) for sk in stage_keys]
    whole = sum(all(p[c] for p in present) for c in range(num_chunks))
    partial = sum(0 < sum(p[c] for p in present) < 4 for c in range(num_chunks))
    assert 0 < whole < num_chunks
    assert partial <= num_chunks // 50, f"{partial} of {num_chunks} chunks left partial"
    # Restore every chunk the way a prefill does: lookup, then every stage must verify.
    slots = client.buffer.load_slot_ids[:1]
    restored = 0
    for c, k in enumerate(keys):
        if client.lookup([k]) == 1:
            ok = [client.read(s, [k], slots) == 1 for s in range(4)]
            assert all(ok) or not all(p[c] for p in present)
            restored += all(ok)
        else:
            assert not all(p[c] for p in present)
    assert restored == whole
    assert _value(client.metrics.checksum_failures) == 0
    client.close()


# -- the pool's processes ---------------------------------------------------------------


def test_master_command_line_and_narrow_binds(pool: Pool):
    cluster = load_cluster(pool.config)
    argv = master_argv(cluster, "local", "mooncake_master")
    assert "--enable_http_metadata_server=false" in argv
    assert "--rpc_address=127.0.0.1" in argv and "--metrics_host=127.0.0.1" in argv
    assert "--eviction_high_watermark_ratio=0.9" in argv and "--eviction_ratio=0.05" in argv
    assert "--default_kv_lease_ttl=10000" in argv and "--client_ttl=10" in argv
    master = pool.procs["master"]
    socks = listening_sockets(master.pid)
    assert socks and all(addr == "127.0.0.1" for addr, _ in socks), socks
    for p in pool.procs.values():
        env = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        assert b"MC_TCP_BIND_ADDRESS=127.0.0.1" in env


def _store_config(tmp: Path, pool: Pool, **store: object) -> Path:
    cluster = load_cluster(pool.config)
    port = int(master_address(cluster, "local").rsplit(":", 1)[1])
    ports = free_ports(6)
    ports[0] = port
    cfg = pool_cluster_dict(ports, store_sizes=("16MiB",))
    cfg["pool"]["stores"][0].update(store)
    path = tmp / "store.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run_store(config: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **env_extra}
    return subprocess.run(
        store_argv(config, 0), capture_output=True, text=True, env=env, timeout=60
    )


def test_store_with_unreserved_huge_pages_fails_clearly(pool: Pool, tmp_path: Path):
    free = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("HugePages_Free")
        ),
        0,
    )
    if free * 2 * 1024 * 1024 >= 16 << 20:
        pytest.skip("this host has huge pages reserved")
    res = _run_store(_store_config(tmp_path, pool, hugepages=True), {})
    assert res.returncode == 2
    assert "huge pages failed" in res.stderr and "HugePages_Free" in res.stderr


def test_store_refuses_another_advertised_address(pool: Pool, tmp_path: Path):
    res = _run_store(_store_config(tmp_path, pool), {"MC_TCP_BIND_ADDRESS": "10.9.9.9"})
    assert res.returncode == 2 and "MC_TCP_BIND_ADDRESS" in res.stderr


def test_numa_plan(tmp_path: Path):
    one = tmp_path / "one"
    (one / "node0").mkdir(parents=True)
    two = tmp_path / "two"
    for n in ("node0", "node1", "online"):
        (two / n).mkdir(parents=True)
    assert numa_plan(None, sysfs=str(two)).argv_prefix == ()
    assert "ignored" in numa_plan(1, sysfs=str(one)).message
    plan = numa_plan(1, sysfs=str(two), which=lambda _: "/usr/bin/numactl")
    assert plan.argv_prefix == ("numactl", "--cpunodebind=1", "--membind=1")
    missing = numa_plan(1, sysfs=str(two), which=lambda _: None)
    assert missing.argv_prefix == () and "numactl not found" in missing.message
    with pytest.raises(ValueError, match="does not exist"):
        numa_plan(5, sysfs=str(two))


def test_kvpool_imports_from_this_repo():
    import kvpool

    root = Path(__file__).resolve().parent.parent
    assert Path(kvpool.__file__).resolve().parent == root / "kvpool"
    assert sys.modules["kvpool"] is kvpool

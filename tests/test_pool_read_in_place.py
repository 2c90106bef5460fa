"""Reading pool objects in place, on a real Mooncake pool (master + one store service over
tcp on loopback) and clients that mount their own segment, as a prefill instance with
`pool.stores[].prefill` does: `locate` finds what lies in the own segment (and only that),
PoolClient.read(in_place=True) reads it there with nothing copied, byte for byte; an
object elsewhere falls back to get_into; a damaged object is refused on the in-place path
as on the copying one (header at read, payload at confirm) and removed; a lease that ended
before the use did makes the read a miss. The engine-level check (byte-exact KV, greedy
output) is tests/test_e2e_pool_in_prefill.py; the worker's restore in place (CPU, and
CUDA under -m gpu) tests/test_pool_read_in_place_worker.py."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator

import pytest
import torch
from pool_harness import Pool, start_pool
from prometheus_client import CollectorRegistry

from kvpool.backend import BackendConfig, PoolBackend, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from protocol.ids import ChunkKey
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace

pytestmark = pytest.mark.timeout(180)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
NS = KVNamespace(
    weights_fingerprint="inplace", kv_dtype="float32", block_size=16, layer_split=(1, 1), rope="r"
)
SEGMENT = 16 << 20


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(4, "little") * 4)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    p = start_pool(tmp_path_factory.mktemp("inplace"), store_sizes=("16MiB",))
    yield p
    p.stop()


def _backend(pool: Pool, segment: int = SEGMENT, lease_ttl_s: float = 10.0) -> PoolBackend:
    return create_backend(
        "mooncake",
        BackendConfig(
            "127.0.0.1",
            pool.master_address,
            segment_bytes=segment,
            master_http=pool.metrics_url.removeprefix("http://"),
            lease_ttl_s=lease_ttl_s,
        ),
    )


def _client(backend: PoolBackend) -> PoolClient:
    return PoolClient(
        backend,
        NS,
        LAYOUT,
        buffer_bytes=2 << 20,
        max_save_chunks=4,
        metrics=PoolMetrics(CollectorRegistry(), "test"),
    )


def _save(client: PoolClient, keys: list[ChunkKey], seed: int) -> list[list[torch.Tensor]]:
    """Random payloads for both stages of `keys`, saved; returns them [chunk][stage]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    slots = []
    ids = iter(client.buffer.save_slot_ids)
    for _ in keys:
        chunk_slots, chunk = [], []
        for stage in client.local_stages:
            s = next(ids)
            spec = client.specs[stage.index]
            payload = torch.randn(spec.shape, generator=g)
            client.buffer.payload(s, spec).copy_(payload)
            chunk_slots.append(s)
            chunk.append(payload)
        slots.append(chunk_slots)
        out.append(chunk)
    assert client.save_chunks(keys, slots) == keys
    return out


def test_locate_finds_only_what_lies_in_the_own_segment(pool: Pool) -> None:
    mine, other, pure = _backend(pool), _backend(pool), _backend(pool, segment=0)
    try:
        assert [n for _, n in mine.own_segments()] == [SEGMENT]
        assert pure.own_segments() == [] and pure.locate(["x"]) == [None]
        src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
        for b in (mine, other):
            b.register_buffer(src.data_ptr(), src.numel())
        n = 100_000
        assert mine.put_from(["a"], [src.data_ptr()], [n], ["g"])[0].value == "ok"
        assert other.put_from(["b"], [src.data_ptr() + 8], [n], ["g"])[0].value == "ok"
        a, b, missing = mine.locate(["a", "b", "nothing"])
        assert b is None and missing is None  # "b" is in the other client's segment
        assert a is not None and a.size == n
        ((base, size),) = mine.own_segments()
        assert base <= a.ptr and a.ptr + n <= base + size
        assert a.lease_until > time.monotonic() + 5
        # The replica's own bytes, read at its address in this process.
        view = torch.frombuffer(bytearray(n), dtype=torch.uint8)
        ctypes.memmove(view.data_ptr(), a.ptr, n)
        assert torch.equal(view, src[:n])
        assert other.locate(["b"])[0] is not None and other.locate(["a"]) == [None]
    finally:
        for b in (mine, other, pure):
            b.close()


def test_read_in_place_is_byte_exact_and_falls_back_for_objects_elsewhere(pool: Pool) -> None:
    mine, other = _client(_backend(pool)), _client(_backend(pool))
    try:
        assert mine.direct and other.direct
        keys = [_key(i) for i in range(3)]
        saved = _save(mine, keys[:2], seed=1)
        saved += _save(other, keys[2:], seed=2)  # in the other client's segment
        slots = mine.buffer.load_slot_ids[:3]
        for stage in (0, 1):
            spec = mine.specs[stage]
            assert mine.read(stage, keys, slots, in_place=True) == 3
            assert [mine.buffer.in_place(s) for s in slots] == [True, True, False]
            for c in range(3):
                assert torch.equal(mine.buffer.payload(slots[c], spec), saved[c][stage])
            assert mine.confirm(stage, keys, slots, 3) == 3
            # Without in_place everything is copied into the slots, the same bytes.
            assert mine.read(stage, keys, slots) == 3
            assert not any(mine.buffer.in_place(s) for s in slots)
            for c in range(3):
                assert torch.equal(mine.buffer.payload(slots[c], spec), saved[c][stage])
    finally:
        mine.close()
        other.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_damaged_object_is_refused_in_place_and_removed(pool: Pool, where: str) -> None:
    client = _client(_backend(pool))
    try:
        keys = [_key(10 + i) for i in range(3)]
        _save(client, keys, seed=3)
        slots = client.buffer.load_slot_ids[:3]
        spec = client.specs[1]
        rep = client.backend.locate([client.keys.object_key(keys[1], 1)])[0]
        assert rep is not None
        # Damage the stored object itself, in the segment (as a bad DIMM or a stray
        # write would): one bit of the payload, or of the header.
        offset = rep.size - 7 if where == "payload" else 40
        byte = ctypes.c_uint8.from_address(rep.ptr + offset)
        byte.value ^= 0x10
        n = client.read(1, keys, slots, in_place=True)
        if where == "header":
            assert n == 1  # refused by read(), before anything used it
        else:
            assert n == 3  # the payload is checked where it is used: by confirm
            assert client.buffer.payload(slots[1], spec).shape == spec.shape
            assert client.confirm(1, keys, slots, n) == 1
        assert client.backend.exists([client.keys.object_key(keys[1], 1)]) == [False]
        assert client.backend.exists([client.keys.object_key(keys[0], 1)]) == [True]
    finally:
        client.close()


def test_a_lease_that_ended_before_the_use_did_is_a_miss(pool: Pool) -> None:
    """The lease the lookup took is what keeps an object in place while it is used: once
    it has ended (here: a client told the master's lease is 0.2 s), confirm refuses the
    object (a miss), without removing it."""
    client = _client(_backend(pool, lease_ttl_s=0.2))
    try:
        keys = [_key(20), _key(21)]
        _save(client, keys, seed=4)
        slots = client.buffer.load_slot_ids[:2]
        assert client.read(0, keys, slots, in_place=True) == 2
        assert client.buffer.in_place(slots[0])
        time.sleep(0.3)
        assert not client.lease_held(slots[0])
        assert client.confirm(0, keys, slots, 2) == 0
        assert client.backend.exists([client.keys.object_key(keys[0], 0)]) == [True]
    finally:
        client.close()

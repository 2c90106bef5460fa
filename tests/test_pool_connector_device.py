"""The pool connector's verified restore on each device it runs on (CPU here, CUDA where there is
one) over the in-process "local" backend: the payload checksum is computed where the
payload is packed (device before D2H, or host) and verified where it is unpacked (on a GPU
after its H2D copy); a damaged object ends the leading run before its chunk, is counted
and removed, and its chunk's blocks are never reported."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.kv_connector import StepKV, WorkerPlace
from engine.request import Request
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.stats import StageCounters
from prefill_worker.pool_connector import PoolScheduler, PoolWorker
from protocol.ids import BlockHash, RequestId
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace
from protocol.sampling import SamplingParams

CHUNK = 256
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
NS = KVNamespace(
    weights_fingerprint="w0", kv_dtype="float32", block_size=16, layer_split=(2, 2), rope="r"
)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _connector(address: str, kv: list[torch.Tensor]) -> tuple[PoolScheduler, PoolWorker]:
    """Both sides of the pool connector in one process (both stages of NS local)."""
    counters = StageCounters()
    backend = create_backend("local", BackendConfig("127.0.0.1", address))
    client = PoolClient(
        backend,
        NS,
        LAYOUT,
        buffer_bytes=4 << 20,
        max_save_chunks=4,
        metrics=counters,
        pin_memory=kv[0].device.type == "cuda",
    )
    worker = PoolWorker(client, counters)
    worker.register_kv_caches(kv, WorkerPlace(0, LAYOUT.num_layers))
    return PoolScheduler(client, PoolMetrics(CollectorRegistry(), "test"), 16), worker


def _save(conn: tuple[PoolScheduler, PoolWorker], req: Request, blocks: list[int]) -> None:
    sched, worker = conn
    step = 4 * CHUNK  # save as prefill steps do, 4 chunks at a time
    for start in range(0, req.num_prompt_tokens, step):
        end = min(start + step, req.num_prompt_tokens)
        meta = sched.build_step_meta([StepKV(req, start, end, blocks)])  # type: ignore[arg-type]
        worker.start_loads(meta)
        worker.start_saves(meta)
        assert worker.drain_saves(10)
        sched.update_from_workers([worker.get_finished()])
    deadline = time.monotonic() + 10
    while sched.has_pending() and time.monotonic() < deadline:
        meta = sched.build_step_meta([])  # idle steps, as the engine polls: chunks that
        worker.start_loads(meta)  # waited for a save slot leave as reports free slots
        worker.start_saves(meta)
        sched.update_from_workers([worker.get_finished()])
        time.sleep(0.005)
    assert not sched.has_pending()


def _load(
    conn: tuple[PoolScheduler, PoolWorker],
    req: Request,
    blocks: list[int],
    end: int,
    gpu_prefix: int = 0,
) -> int:
    """Restore tokens gpu_prefix .. end (the first gpu_prefix hit the GPU cache)."""
    sched, worker = conn
    req.num_computed_tokens = gpu_prefix
    sched.update_state_after_alloc(req, blocks, end - gpu_prefix)  # type: ignore[arg-type]
    worker.start_loads(sched.build_step_meta([]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = sched.update_from_workers([worker.get_finished()]).finished_loads
        if done:
            return done[req.request_id]
        time.sleep(0.01)
    raise AssertionError("load did not finish")


def _count(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_chunks", "victim"), [(3, 1), (10, 6)])
def test_verified_restore_stops_before_a_damaged_object(
    device: str, num_chunks: int, victim: int
) -> None:
    """10 chunks: the GPU restore verifies and unpacks groups of 4 while the next group's
    copy runs; the damaged chunk sits in the second group."""
    g = torch.Generator().manual_seed(0)
    nblk = num_chunks * CHUNK // 16 + 16
    kv_a = [torch.randn(2, nblk, 16, 2, 16, generator=g).to(device) for _ in range(4)]
    kv_b = [torch.zeros(2, nblk, 16, 2, 16, device=device) for _ in range(4)]
    address = f"local-device-{device}-{num_chunks}"
    a, b = _connector(address, kv_a), _connector(address, kv_b)
    try:
        prompt = list(range(100, 100 + num_chunks * CHUNK + 10))
        req = Request(
            RequestId("r0"),
            prompt,
            SamplingParams(max_tokens=1),
            block_size=16,
            hash_root=BlockHash(b"\x01" * 16),
        )
        blocks_a = list(range(nblk - 1, -1, -1))[: len(prompt) // 16 + 1]
        _save(a, req, blocks_a)
        assert _count(a[0].metrics.save_chunks) == num_chunks
        blocks_b = list(range(3, 3 + num_chunks * CHUNK // 16))

        def same(chunks: int) -> bool:
            n = chunks * CHUNK // 16
            return all(
                torch.equal(kb[:, blocks_b[:n]], ka[:, blocks_a[:n]])
                for ka, kb in zip(kv_a, kv_b, strict=True)
            )

        assert _load(b, req, blocks_b, num_chunks * CHUNK) == num_chunks * CHUNK
        assert same(num_chunks)
        for k in kv_b:
            k.zero_()
        # Flip one payload bit of chunk `victim`'s stage-1 object and store it back.
        client = a[0].client
        keys = a[0]._keys(req, 0, num_chunks)
        victim_key = client.keys.object_key(keys[victim], 1)
        slot = client.buffer.load_slot_ids[0]
        n = client.specs[1].object_bytes
        assert client.backend.get_into(
            [victim_key], [client.buffer.ptr(slot)], [client.buffer.slot_bytes]
        ) == [n]
        client.buffer.object(slot)[n - 5] ^= 0x08
        client.backend.remove([victim_key])
        client.backend.put_from(
            [victim_key], [client.buffer.ptr(slot)], [n], [client.keys.group_id(keys[victim])]
        )
        # The chunks before the damaged one only.
        assert _load(b, req, blocks_b, num_chunks * CHUNK) == victim * CHUNK
        assert same(victim)
        m = b[0].metrics
        assert _count(m.checksum_failures) == 1
        assert _count(m.failures, instance="test", op="load", reason="checksum") == 1
        assert client.backend.exists([victim_key]) == [False]  # removed
    finally:
        a[1].close()
        b[1].close()


@pytest.mark.parametrize("device", DEVICES)
def test_restore_behind_a_gpu_prefix_leaves_its_blocks_alone(device: str) -> None:
    """A GPU prefix of 3 blocks ends inside chunk 0: the restore writes that chunk's other
    blocks (the GPU path unpacks it on its own, then whole chunks in groups of 4) and never
    the prefix's blocks."""
    num_chunks, prefix_blocks = 6, 3
    g = torch.Generator().manual_seed(1)
    nblk = num_chunks * CHUNK // 16 + 16
    kv_a = [torch.randn(2, nblk, 16, 2, 16, generator=g).to(device) for _ in range(4)]
    kv_b = [torch.zeros(2, nblk, 16, 2, 16, device=device) for _ in range(4)]
    address = f"local-prefix-{device}"
    a, b = _connector(address, kv_a), _connector(address, kv_b)
    try:
        prompt = list(range(300, 300 + num_chunks * CHUNK + 10))
        req = Request(
            RequestId("r1"),
            prompt,
            SamplingParams(max_tokens=1),
            block_size=16,
            hash_root=BlockHash(b"\x03" * 16),
        )
        blocks_a = list(range(nblk - 1, -1, -1))[: len(prompt) // 16 + 1]
        _save(a, req, blocks_a)
        blocks_b = list(range(5, 5 + num_chunks * CHUNK // 16))
        end = num_chunks * CHUNK
        assert _load(b, req, blocks_b, end, gpu_prefix=prefix_blocks * 16) == end - 48
        n = end // 16
        for ka, kb in zip(kv_a, kv_b, strict=True):
            assert not kb[:, blocks_b[:prefix_blocks]].any()
            assert torch.equal(kb[:, blocks_b[prefix_blocks:n]], ka[:, blocks_a[prefix_blocks:n]])
    finally:
        a[1].close()
        b[1].close()

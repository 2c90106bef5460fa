"""The worker's restore of objects in its own pool segment, read in place on a GPU (-m gpu,
the lent machine; self-contained: the in-process "local" backend mounts the segment, as a
prefill instance with `pool.stores[].prefill` does with Mooncake, which this machine may
lack).

An 8B-shaped stage (32 layers x 8 KV heads x 128, bf16: 32 MiB per 256-token chunk) saves
32 chunks (1 GiB) into the worker's own segment, then restores them into other pages of
the same caches: the client registers the segment with CUDA once, and the H2D copies run
straight from each object's address (no copy into the load slots first), then checksum
and unpack on the device as for any restore. The pages must equal the saved ones bit for
bit. The same restore copying through the load slots runs in the same process for
comparison (best of 3 after a warm-up each). Then: a damaged object in the segment ends
the restore before it (and is removed); a lease that has ended before the copies did makes
the objects a miss (not removed).
"""

from __future__ import annotations

import ctypes
import itertools
import time

import msgspec
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
from protocol.pool_messages import PoolWorkerReport
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.gpu

CHUNK, BS, L, H, D = 256, 16, 32, 8, 128
NUM_CHUNKS = 32
SAVE_CHUNKS = 4
OBJECT_BYTES = CHUNK * L * 2 * H * D * 2 + 4096
SEGMENT_BYTES = NUM_CHUNKS * OBJECT_BYTES + (16 << 20)
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype="bfloat16")
NS = KVNamespace(
    weights_fingerprint="w8b-inplace",
    kv_dtype="bfloat16",
    block_size=BS,
    layer_split=(L,),
    rope="r",
)
_report_decoder = msgspec.msgpack.Decoder(PoolWorkerReport)
_ids = itertools.count()


class _Conn:
    """One connector (scheduler + worker) over a local pool whose memory is the worker's
    own segment."""

    def __init__(self, kv: list[torch.Tensor], lease_ttl_s: float = 10.0) -> None:
        backend = create_backend(
            "local",
            BackendConfig(
                "127.0.0.1",
                f"inplace-gpu-{next(_ids)}?capacity={2 * SEGMENT_BYTES}",
                segment_bytes=SEGMENT_BYTES,
                lease_ttl_s=lease_ttl_s,
            ),
        )
        counters = StageCounters()
        self.client = PoolClient(
            backend,
            NS,
            LAYOUT,
            buffer_bytes=640 << 20,
            max_save_chunks=SAVE_CHUNKS,
            metrics=counters,
            pin_memory=True,
        )
        assert self.client.direct, "the segment was not registered with CUDA"
        self.worker = PoolWorker(self.client, counters)
        self.worker.register_kv_caches(kv, WorkerPlace(0, L))
        self.metrics = PoolMetrics(CollectorRegistry(), "gpu")
        self.sched = PoolScheduler(self.client, self.metrics, BS)

    def saved(self) -> int:
        report = self.worker.get_finished()
        self.sched.update_from_workers([report])
        return len(_report_decoder.decode(report).saved) if report else 0

    def save(self, req: Request, blocks: list[int]) -> None:
        step = SAVE_CHUNKS * CHUNK
        saved = 0
        for start in range(0, req.num_prompt_tokens, step):
            end = min(start + step, req.num_prompt_tokens)
            meta = self.sched.build_step_meta([StepKV(req, start, end, blocks)])  # type: ignore[arg-type]
            self.worker.start_loads(meta)
            self.worker.start_saves(meta)
            assert self.worker.drain_saves(120)
            saved += self.saved()
        deadline = time.monotonic() + 10
        while saved < req.num_prompt_tokens // CHUNK and time.monotonic() < deadline:
            saved += self.saved()
            time.sleep(0.01)
        assert saved == req.num_prompt_tokens // CHUNK, f"only {saved} chunks were stored"

    def restore(self, req: Request, blocks: list[int], n: int) -> tuple[int, float]:
        """Tokens restored into `blocks` and the seconds from the load to its report."""
        req.num_computed_tokens = 0
        self.sched.update_state_after_alloc(req, blocks, n)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.worker.start_loads(self.sched.build_step_meta([]))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = self.sched.update_from_workers([self.worker.get_finished()]).finished_loads
            if done:
                return done[RequestId(req.request_id)], time.perf_counter() - t0
            time.sleep(0.0005)
        raise AssertionError("the restore never finished")

    def object_addr(self, chunk: int, req_keys: list) -> tuple[int, int]:  # type: ignore[type-arg]
        rep = self.client.backend.locate([self.client.keys.object_key(req_keys[chunk], 0)])[0]
        assert rep is not None
        return rep.ptr, rep.size

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def _request(n: int, seed: int) -> Request:
    return Request(
        RequestId(f"r{seed}"),
        list(range(seed * 100_000, seed * 100_000 + n + 5)),
        SamplingParams(max_tokens=1),
        block_size=BS,
        hash_root=BlockHash(bytes([seed]) * 16),
    )


def _kv(nblk: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(2, nblk, BS, H, D, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(L)
    ]


def test_restore_in_place_on_the_gpu_is_exact_and_skips_the_slot_copy():
    n = NUM_CHUNKS * CHUNK
    nblk = 2 * (n // BS) + 16
    kv = _kv(nblk)
    conn = _Conn(kv)
    req = _request(n, 1)
    try:
        blocks_a = list(range(n // BS + 8))  # the saved pages (and the partial last one)
        blocks_b = list(range(n // BS + 8, 2 * (n // BS) + 8))
        conn.save(req, blocks_a)
        want = [k[:, blocks_a[: n // BS]].clone() for k in kv]
        runs: dict[bool, list[float]] = {True: [], False: []}
        for direct in (True, False, True, False, True, False, True, False):
            conn.client.direct = direct
            for k in kv:
                k[:, blocks_b].zero_()
            before = conn.metrics.load_in_place._value.get()
            loaded, secs = conn.restore(req, blocks_b, n)
            assert loaded == n
            in_place = conn.metrics.load_in_place._value.get() - before
            assert in_place == (NUM_CHUNKS if direct else 0), (direct, in_place)
            for k, w in zip(kv, want, strict=True):
                assert torch.equal(k[:, blocks_b], w)
            runs[direct].append(secs)
        best_in_place, best_copy = min(runs[True][1:]), min(runs[False][1:])

        nbytes = n * LAYOUT.bytes_per_token
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d = nbytes / (time.perf_counter() - t) / 1e9
        gbs = nbytes / best_in_place / 1e9
        print(
            f"\nrestore of {nbytes / 1e9:.2f} GB from the worker's own segment: in place "
            f"{best_in_place * 1e3:.0f} ms = {gbs:.1f} GB/s = {gbs / h2d:.0%} of pinned H2D "
            f"{h2d:.1f} GB/s; through the load slots {best_copy * 1e3:.0f} ms "
            f"({nbytes / best_copy / 1e9:.1f} GB/s); best of 3 after a warm-up each"
        )
        assert best_in_place < best_copy, "reading in place was not faster than copying"
        assert gbs > 0.5 * h2d, "the in-place restore is far below pinned H2D"
    finally:
        conn.close()


def test_a_damaged_object_in_the_segment_ends_the_restore_and_is_removed():
    chunks = 8
    n = chunks * CHUNK
    nblk = 2 * (n // BS) + 16
    kv = _kv(nblk)
    conn = _Conn(kv)
    req = _request(n, 2)
    try:
        blocks_a = list(range(n // BS + 8))
        blocks_b = list(range(n // BS + 8, 2 * (n // BS) + 8))
        conn.save(req, blocks_a)
        keys = conn.sched._keys(req, 0, chunks)  # the chunks' pool keys, in order
        ptr, size = conn.object_addr(5, keys)
        byte = ctypes.c_uint8.from_address(ptr + size - 3)  # in chunk 5's payload
        byte.value ^= 0x20
        loaded, _ = conn.restore(req, blocks_b, n)
        assert loaded == 5 * CHUNK  # chunks 0-4, verified; chunk 5 refused
        assert conn.client.backend.exists([conn.client.keys.object_key(keys[5], 0)]) == [False]
        for k in kv:
            assert torch.equal(k[:, blocks_b[: 5 * CHUNK // BS]], k[:, blocks_a[: 5 * CHUNK // BS]])
    finally:
        conn.close()


def test_a_lease_that_ended_before_the_copies_makes_a_miss_not_a_removal():
    chunks = 4
    n = chunks * CHUNK
    nblk = 2 * (n // BS) + 16
    kv = _kv(nblk)
    conn = _Conn(kv, lease_ttl_s=0.0)  # every lease has ended by the time a copy is done
    req = _request(n, 3)
    try:
        blocks_a = list(range(n // BS + 8))
        blocks_b = list(range(n // BS + 8, 2 * (n // BS) + 8))
        conn.save(req, blocks_a)
        loaded, _ = conn.restore(req, blocks_b, n)
        assert loaded == 0
        keys = conn.sched._keys(req, 0, chunks)
        assert all(conn.client.backend.exists([conn.client.keys.object_key(k, 0) for k in keys]))
    finally:
        conn.close()

"""The worker's restore of objects in its own pool segment, read in place, on the CPU and
on a GPU (the "cuda" cases are -m gpu, for the lent machine). Self-contained: the
in-process "local" backend mounts the segment, as a prefill instance with
`pool.stores[].prefill` does with Mooncake (which the GPU machine may lack; the real
Mooncake path is tests/test_pool_read_in_place.py and tests/test_e2e_pool_in_prefill.py).

On CUDA an 8B-shaped stage (32 layers x 8 KV heads x 128, bf16: 32 MiB per 256-token
chunk) saves 32 chunks (1 GiB) into the worker's own segment, then restores them into
other pages of the same caches: the client registers the segment with CUDA once, and the
H2D copies run straight from each object's address (no copy into the load slots first),
then checksum and unpack on the device as for any restore. On the CPU (a small stage) the
unpack reads the segment and `confirm` checks the payloads it used. The pages must equal
the saved ones bit for bit. The same restore copying through the load slots alternates
with it in the same process (CUDA: best of 3 after a warm-up each; in place must be the
faster). Then: a damaged object in the segment ends the restore before it (and is
removed); a lease that has ended before the copies did makes the objects a miss (not
removed).
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
from protocol.ids import BlockHash, ChunkKey, RequestId
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace
from protocol.pool_messages import PoolWorkerReport
from protocol.sampling import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CHUNK, BS = 256, 16
SAVE_CHUNKS = 4
_report_decoder = msgspec.msgpack.Decoder(PoolWorkerReport)
_ids = itertools.count()


class Geometry:
    """The stage's KV shape per device: 8B-shaped on CUDA, small on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.L, self.H, self.D = (32, 8, 128) if device == "cuda" else (4, 2, 32)
        self.num_chunks = 32 if device == "cuda" else 8
        self.layout = KVLayout(
            num_layers=self.L, num_kv_heads=self.H, head_dim=self.D, block_size=BS, dtype="bfloat16"
        )
        self.ns = KVNamespace(
            weights_fingerprint=f"inplace-{device}",
            kv_dtype="bfloat16",
            block_size=BS,
            layer_split=(self.L,),
            rope="r",
        )
        object_bytes = CHUNK * self.layout.bytes_per_token + 4096
        self.segment_bytes = self.num_chunks * object_bytes + (16 << 20)
        self.buffer_bytes = 20 * object_bytes  # 4 save slots, 16 load slots


class _Conn:
    """One connector (scheduler + worker) over a local pool whose memory is the worker's
    own segment."""

    def __init__(self, geo: Geometry, kv: list[torch.Tensor], lease_ttl_s: float = 10.0) -> None:
        backend = create_backend(
            "local",
            BackendConfig(
                "127.0.0.1",
                f"inplace-{geo.device}-{next(_ids)}?capacity={2 * geo.segment_bytes}",
                segment_bytes=geo.segment_bytes,
                lease_ttl_s=lease_ttl_s,
            ),
        )
        counters = StageCounters()
        self.client = PoolClient(
            backend,
            geo.ns,
            geo.layout,
            buffer_bytes=geo.buffer_bytes,
            max_save_chunks=SAVE_CHUNKS,
            metrics=counters,
            pin_memory=geo.device == "cuda",
        )
        assert self.client.direct, "the own segment cannot be read in place"
        self.device = geo.device
        self.worker = PoolWorker(self.client, counters)
        self.worker.register_kv_caches(kv, WorkerPlace(0, geo.L))
        self.metrics = PoolMetrics(CollectorRegistry(), "inplace")
        self.sched = PoolScheduler(self.client, self.metrics, BS)

    def _saved(self) -> int:
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
            saved += self._saved()
        want = req.num_prompt_tokens // CHUNK
        deadline = time.monotonic() + 10  # the last batch is reported after its slots free
        while saved < want and time.monotonic() < deadline:
            saved += self._saved()
            time.sleep(0.01)
        assert saved == want, f"only {saved} of {want} chunks were stored"

    def restore(self, req: Request, blocks: list[int], n: int) -> tuple[int, float]:
        """Tokens restored into `blocks` and the seconds from the load to its report."""
        req.num_computed_tokens = 0
        self.sched.update_state_after_alloc(req, blocks, n)  # type: ignore[arg-type]
        if self.device == "cuda":
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

    def key(self, chunk: ChunkKey) -> str:
        return self.client.keys.object_key(chunk, 0)

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


def _setup(
    device: str, chunks: int | None = None, lease_ttl_s: float = 10.0
) -> tuple[Geometry, list[torch.Tensor], _Conn, Request, list[int], list[int]]:
    """A connector over a fresh own segment, `chunks` chunks of a request saved from
    blocks_a; blocks_b are free pages of the same caches to restore into."""
    geo = Geometry(device)
    n = (chunks or geo.num_chunks) * CHUNK
    g = torch.Generator(device=device).manual_seed(0)
    kv = [
        torch.randn(2, 2 * (n // BS) + 16, BS, geo.H, geo.D, device=device, generator=g).to(
            torch.bfloat16
        )
        for _ in range(geo.L)
    ]
    conn = _Conn(geo, kv, lease_ttl_s)
    req = _request(n, 1 + next(_ids) % 200)
    blocks_a = list(range(n // BS + 8))  # the saved pages (and the partial last one)
    blocks_b = list(range(n // BS + 8, 2 * (n // BS) + 8))
    try:
        conn.save(req, blocks_a)
    except BaseException:
        conn.close()
        raise
    return geo, kv, conn, req, blocks_a, blocks_b


def _same(kv: list[torch.Tensor], a: list[int], b: list[int]) -> bool:
    return all(torch.equal(k[:, b], k[:, a]) for k in kv)


@pytest.mark.parametrize("device", DEVICES)
def test_restore_in_place_is_exact_and_skips_the_slot_copy(device: str):
    geo, kv, conn, req, blocks_a, blocks_b = _setup(device)
    n = geo.num_chunks * CHUNK
    saved_pages = blocks_a[: n // BS]
    try:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for direct in (True, False) * 4:
            conn.client.direct = direct
            for k in kv:
                k[:, blocks_b].zero_()
            before = conn.metrics.load_in_place._value.get()
            loaded, secs = conn.restore(req, blocks_b, n)
            assert loaded == n
            in_place = conn.metrics.load_in_place._value.get() - before
            assert in_place == (geo.num_chunks if direct else 0), (direct, in_place)
            assert _same(kv, saved_pages, blocks_b)
            runs[direct].append(secs)
        if device != "cuda":
            return
        best_in_place, best_copy = min(runs[True][1:]), min(runs[False][1:])
        nbytes = n * geo.layout.bytes_per_token
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


@pytest.mark.parametrize("device", DEVICES)
def test_a_damaged_object_in_the_segment_ends_the_restore_and_is_removed(device: str):
    chunks = 8
    _, kv, conn, req, blocks_a, blocks_b = _setup(device, chunks)
    try:
        keys = conn.sched._keys(req, 0, chunks)  # the chunks' pool keys, in order
        rep = conn.client.backend.locate([conn.key(keys[5])])[0]
        assert rep is not None
        # One bit of chunk 5's stored payload, in the segment (a bad DIMM, a stray write).
        byte = ctypes.c_uint8.from_address(rep.ptr + rep.size - 3)
        byte.value ^= 0x20
        loaded, _ = conn.restore(req, blocks_b, chunks * CHUNK)
        assert loaded == 5 * CHUNK  # chunks 0-4, verified; chunk 5 refused
        assert conn.client.backend.exists([conn.key(keys[5])]) == [False]
        assert conn.client.backend.exists([conn.key(keys[4])]) == [True]
        assert _same(kv, blocks_a[: 5 * CHUNK // BS], blocks_b[: 5 * CHUNK // BS])
    finally:
        conn.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_lease_that_ended_before_the_copies_makes_a_miss_not_a_removal(device: str):
    chunks = 4
    # A lease of 0 s: every object's lease has ended by the time its use is done.
    _, _, conn, req, _, blocks_b = _setup(device, chunks, lease_ttl_s=0.0)
    try:
        loaded, _ = conn.restore(req, blocks_b, chunks * CHUNK)
        assert loaded == 0
        keys = conn.sched._keys(req, 0, chunks)
        assert conn.client.backend.exists([conn.key(k) for k in keys]) == [True] * chunks
    finally:
        conn.close()

"""The engine with the pool connector on a real pool (master + two store services over
tcp on loopback), without HTTP: restores across engines with a 3-stage layer split,
a tampered object (caught, removed, counted, recomputed from that chunk), other
namespaces (weights, KV dtype) never restoring, and forced eviction with many sessions:
no partial chunk is ever restored, every prompt token is counted once, and every output
equals a cold run's."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_tiny_model
from pool_harness import Pool, start_pool
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.stats import StageCounters
from prefill_worker.pool_connector import PoolScheduler, PoolWorker
from protocol.hashing import chunk_keys, hash_chain, namespace_seed
from protocol.ids import ChunkKey
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)
CHUNK = 256
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SPLIT = (1, 1, 1)
"""The tiny model's 3 layers as three pool stages: one object per (chunk, stage)."""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    # 2 x 16 MiB (Mooncake's smallest segment): ~80 chunks of the tiny model (3 objects
    # of 132 KiB each).
    p = start_pool(tmp_path_factory.mktemp("pool"), store_sizes=("16MiB", "16MiB"), lease_ttl_s=2.0)
    yield p
    p.stop()


def _engine(
    model: Path, cache_dir: str, pool: Pool | None, dtype: str = "float32", kv: str = "auto"
) -> LLMEngine:
    cfg = EngineConfig(
        cache_dir=cache_dir,
        num_blocks=512,
        max_num_batched_tokens=1024,
        dtype=dtype,
        kv_cache_dtype=kv,
    )
    e = LLMEngine.from_spec(str(model), cfg)
    if pool is not None:
        backend = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
        namespace = msgspec.structs.replace(e.namespace, layer_split=SPLIT)
        _connect(e, backend, namespace, buffer_bytes=4 << 20, max_save_chunks=8)
    return e


def _connect(e: LLMEngine, backend, namespace, **kw) -> PoolMetrics:  # type: ignore[no-untyped-def]
    """Both sides of the pool connector in the engine's process (every stage local)."""
    counters = StageCounters()
    client = PoolClient(backend, namespace, e.layout, metrics=counters, **kw)
    metrics = PoolMetrics(CollectorRegistry(), "test")
    worker = PoolWorker(client, counters)
    e.set_kv_connector(PoolScheduler(client, metrics, 16, wake=worker.wake), worker)
    return metrics


def _conn(e: LLMEngine) -> PoolScheduler:
    assert isinstance(e.connector, PoolScheduler)
    return e.connector


def settle(e: LLMEngine, timeout_s: float = 30) -> None:
    """Step the idle engine until its connector has nothing outstanding (saves written
    and reported, metrics applied)."""
    deadline = time.monotonic() + timeout_s
    while e.has_unfinished():
        assert time.monotonic() < deadline, "the pool connector did not settle"
        e.step()


def _value(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, weights_cache_dir: str, pool: Pool):
    a = _engine(tiny_llama_dir, weights_cache_dir, pool)
    b = _engine(tiny_llama_dir, weights_cache_dir, pool)
    cold = _engine(tiny_llama_dir, weights_cache_dir, None)
    yield a, b, cold
    for e in (a, b, cold):
        e.close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _run(e: LLMEngine, prompt: list[int]) -> Completion:
    out = e.generate([prompt], GREEDY)[0]
    settle(e)
    return out


def _chunk_keys(e: LLMEngine, prompt: list[int]) -> list[ChunkKey]:
    root = namespace_seed(e.namespace.key())
    hashes = hash_chain(prompt, 16, root)
    return [ChunkKey(bytes(k)) for k in chunk_keys(hashes, CHUNK // 16)]


def test_restore_across_engines_with_three_stages(engines):
    a, b, cold = engines
    p = _prompt(1, 700)
    first = _run(a, p)
    assert first.num_pool_tokens == 0
    assert _value(_conn(a).metrics.save_chunks) == 2
    got = _run(b, p)
    assert got.num_pool_tokens == 2 * CHUNK and got.num_cached_tokens == 0
    assert got.token_ids == _run(cold, p).token_ids == first.token_ids
    m = _conn(b).metrics
    for stage in ("0", "1", "2"):
        assert m.restore_seconds.labels(instance="test", stage=stage)._sum.get() > 0
    assert _value(m.hit_chunks) == 2 and _value(m.restored_tokens) == 2 * CHUNK
    # b computed nothing new to save: chunks 0-1 came from the pool.
    assert _value(m.save_chunks) == 0


def test_tampered_stage_object_is_caught_and_recomputed_from_that_chunk(engines):
    a, b, cold = engines
    b.reset_prefix_cache()
    p = _prompt(2, 1000)  # 3 full chunks
    _run(a, p)
    keys = _chunk_keys(a, p)
    client = _conn(a).client
    # Flip a payload byte of chunk 1, stage 2, and store it back (same key, same group).
    victim = client.keys.object_key(keys[1], 2)
    slot = client.buffer.load_slot_ids[0]
    n = client.specs[2].object_bytes
    assert client.backend.get_into(
        [victim], [client.buffer.ptr(slot)], [client.buffer.slot_bytes]
    ) == [n]
    client.buffer.object(slot)[n // 2] ^= 0x10
    client.backend.remove([victim])
    client.backend.put_from(
        [victim], [client.buffer.ptr(slot)], [n], [client.keys.group_id(keys[1])]
    )
    m = _conn(b).metrics
    before = (_value(m.checksum_failures), b.counters.loads_short)
    got = _run(b, p)
    assert got.num_pool_tokens == CHUNK  # chunk 0 only: never the damaged chunk 1
    assert (_value(m.checksum_failures), b.counters.loads_short) == (before[0] + 1, before[1] + 1)
    assert _value(m.failures, instance="test", op="load", reason="checksum") == 1
    assert got.token_ids == _run(cold, p).token_ids
    # The damaged object was removed, and b saved chunks 1-2 after recomputing them:
    # what is under the key now verifies, and the next restore takes all three chunks.
    assert client.read(2, keys[1:2], client.buffer.load_slot_ids[:1]) == 1
    b.reset_prefix_cache()
    again = _run(b, p)
    assert again.num_pool_tokens == 3 * CHUNK and again.token_ids == got.token_ids


def test_other_weights_or_kv_dtype_never_restore(
    engines, pool: Pool, tmp_path: Path, tiny_tokenizer_dir: Path, weights_cache_dir: str
):
    a, _, _ = engines
    p = _prompt(3, 600)
    _run(a, p)
    other_weights = make_tiny_model(tmp_path / "seed1", tiny_tokenizer_dir, "llama", seed=1)
    e1 = _engine(other_weights, weights_cache_dir, pool)
    e2 = _engine(Path(a.info.source.path), weights_cache_dir, pool, dtype="bfloat16")
    try:
        for e in (e1, e2):
            assert e.namespace.key() != a.namespace.key()
            out = _run(e, p)
            assert out.num_pool_tokens == 0 and _value(_conn(e).metrics.hit_chunks) == 0
        # a's chunks are still there for a.
        a.reset_prefix_cache()
        assert _run(a, p).num_pool_tokens == 2 * CHUNK
    finally:
        e1.close()
        e2.close()


def _prefix_kv(e: LLMEngine, prompt: list[int], num_blocks: int) -> torch.Tensor:
    """[L, 2, num_blocks, bs, H, D]: the cached KV of the prompt's first blocks, found
    through the engine's own prefix cache (the prompt's block hash chain)."""
    hashes = hash_chain(prompt, 16, namespace_seed(e.namespace.key()))
    ids = [e.kv.pool.lookup(h) for h in hashes[:num_blocks]]
    assert None not in ids
    idx = torch.tensor(ids)
    return torch.stack([c.index_select(1, idx) for c in e.runner.kv_caches])


def test_bfloat16_kv_restores_bitwise(tiny_llama_dir: Path, weights_cache_dir: str, pool: Pool):
    """bf16 KV (the fast CPU dtype) goes through the pool byte for byte: what b restores
    is exactly what a computed and saved, and b's tokens are a cold bf16 run's."""
    a, b, cold = (
        _engine(tiny_llama_dir, weights_cache_dir, pool if i < 2 else None, dtype="bfloat16")
        for i in range(3)
    )
    try:
        p = _prompt(11, 700)
        first = _run(a, p)
        assert a.runner.kv_caches[0].dtype == torch.bfloat16
        got = _run(b, p)
        assert got.num_pool_tokens == 2 * CHUNK and got.num_cached_tokens == 0
        assert got.token_ids == first.token_ids == _run(cold, p).token_ids
        blocks = 2 * CHUNK // 16
        assert torch.equal(_prefix_kv(b, p, blocks), _prefix_kv(a, p, blocks))
    finally:
        for e in (a, b, cold):
            e.close()


def test_fp8_kv_restores_the_computed_bytes(
    engines, pool: Pool, tiny_llama_dir: Path, weights_cache_dir: str
):
    """fp8_e4m3 KV through the pool: the rows an engine restores (fp8 values and their
    scales) are byte for byte those another engine computed, and the tokens those of a
    cold fp8 run; its namespace is not the float32 KV's."""
    a32 = engines[0]
    a, b, cold = (
        _engine(tiny_llama_dir, weights_cache_dir, where, kv="fp8_e4m3")
        for where in (pool, pool, None)
    )
    try:
        assert a.namespace.key() != a32.namespace.key()
        p = _prompt(5, 700)
        first = _run(a, p)
        got = _run(b, p)
        assert got.num_pool_tokens == 2 * CHUNK and got.num_cached_tokens == 0
        assert got.token_ids == first.token_ids == _run(cold, p).token_ids
        hashes = hash_chain(p, 16, namespace_seed(a.namespace.key()))[: 2 * CHUNK // 16]
        blocks_a = [a.pool.lookup(h) for h in hashes]
        blocks_b = [b.pool.lookup(h) for h in hashes]
        assert None not in blocks_a and None not in blocks_b
        ia, ib = torch.tensor(blocks_a), torch.tensor(blocks_b)
        for ca, cb in zip(a.runner.kv_caches, b.runner.kv_caches, strict=True):
            assert ca.dtype == torch.uint8
            assert torch.equal(ca.index_select(1, ia), cb.index_select(1, ib))
    finally:
        for e in (a, b, cold):
            e.close()


def _pin_filler(pool: Pool, nbytes: int) -> None:
    """Hard-pinned objects (never evicted) that shrink the pool to what is left."""
    import mooncake.store as mc

    store = mc.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", pool.master_address) == 0
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    assert store.register_buffer(buf.data_ptr(), buf.numel()) == 0
    config = mc.ReplicateConfig()
    config.with_hard_pin = True
    n = nbytes >> 20
    keys = [f"filler/{i}" for i in range(n)]
    codes = store.batch_put_from(keys, [buf.data_ptr()] * n, [1 << 20] * n, config)
    assert codes == [0] * n, codes
    store.close()


def test_forced_eviction_many_sessions(engines, pool: Pool):
    """6 sessions x 3 turns (~30 distinct chunks) through a pool pinned down to room for
    ~23 chunks, the GPU cache reset between turns, turns alternating between engines."""
    a, b, cold = engines
    _pin_filler(pool, 24 << 20)
    evictions = pool.master_metric("master_successful_evictions_total")
    sessions = [_prompt(100 + s, 500) for s in range(6)]

    def totals(e: LLMEngine) -> int:
        c = e.counters
        return c.prompt_tokens_cached + c.prompt_tokens_pool + c.prompt_tokens_computed

    base = {id(e): totals(e) for e in (a, b)}
    served = {id(a): 0, id(b): 0}
    restored = computed = 0
    for turn in range(3):
        for s, history in enumerate(sessions):
            e = (a, b)[(s + turn) % 2]
            e.reset_prefix_cache()
            prompt = history + _prompt(1000 * turn + s, 300)
            got = _run(e, prompt)
            want = cold.generate([prompt], GREEDY)[0]
            assert got.token_ids == want.token_ids, f"session {s} turn {turn}"
            # Whole chunks only (the GPU cache was reset), and only of the history.
            assert got.num_cached_tokens == 0 and got.num_pool_tokens % CHUNK == 0
            assert got.num_pool_tokens <= len(history) // CHUNK * CHUNK
            restored += got.num_pool_tokens
            computed += len(prompt) - got.num_pool_tokens
            served[id(e)] += len(prompt)
            sessions[s] = prompt + want.token_ids
    assert pool.master_metric("master_successful_evictions_total") > evictions
    assert restored > 0 and computed > 0  # reuse degrades, it does not vanish
    for e in (a, b):
        # Every prompt token counted once: gpu + pool + computed = prompt tokens served.
        assert totals(e) - base[id(e)] == served[id(e)]
        assert _value(_conn(e).metrics.checksum_failures) <= 1  # the tampered one above
    # The group invariant held: no chunk is left with only some stages in the pool.
    client = _conn(a).client
    keys = [k for h in sessions for k in _chunk_keys(a, h)]
    present = [
        client.backend.exists([client.keys.object_key(k, s) for k in keys]) for s in range(3)
    ]
    partial = sum(0 < sum(p[i] for p in present) < 3 for i in range(len(keys)))
    assert partial <= len(keys) // 50, f"{partial} of {len(keys)} chunks partial"


def test_block_pack_equals_kv_pack_and_unpack_inverts_it():
    from prefill_worker.pool_connector import pack_blocks, unpack_blocks
    from transfer.kv_pack import gather

    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(2, 40, 16, 3, 8, generator=g) for _ in range(3)]
    blocks = torch.randperm(40, generator=g)[:32].tolist()
    out = torch.empty(3, 2, 512, 3, 8)
    pack_blocks(layers, blocks, out)
    want = torch.empty_like(out)
    gather(layers, blocks, 0, 512, want)
    assert torch.equal(out, want)
    dst = [torch.zeros_like(x) for x in layers]
    unpack_blocks(out[:, :, 16 * 5 :], dst, blocks[5:])  # from a block boundary on
    for a, b in zip(layers, dst, strict=True):
        assert torch.equal(a[:, blocks[5:]], b[:, blocks[5:]])
        assert not b[:, blocks[:5]].any()


def test_saturated_save_slots_defer_and_never_stall_compute(tiny_llama_dir, weights_cache_dir):
    """One save slot and a pool whose writes hang until released: the step that computes
    three chunks sends one to be packed, keeps two waiting (counted, none dropped) and
    returns without waiting for the write; once the write is through the waiting chunks
    are packed from the GPU prefix cache (the request has finished) and saved."""
    import threading

    from kvpool.local_backend import LocalBackend

    release = threading.Event()

    class SlowBackend(LocalBackend):
        def put_from(self, keys, ptrs, sizes, group_ids):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().put_from(keys, ptrs, sizes, group_ids)

    cfg = EngineConfig(cache_dir=weights_cache_dir, num_blocks=256, max_num_batched_tokens=1024)
    e = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
    backend = SlowBackend(BackendConfig("127.0.0.1", "local-slow"))
    metrics = _connect(e, backend, e.namespace, buffer_bytes=None, max_save_chunks=1)
    try:
        prompt = _prompt(7, 1000)
        out = e.generate([prompt], GREEDY)[0]  # returns while the write hangs
        assert len(out.token_ids) == 4
        assert _value(metrics.save_deferred) == 2 and _value(metrics.save_waiting) == 2
        assert _value(metrics.save_dropped) == 0 and _conn(e).save_queue.credits == 0
        assert e.has_unfinished()  # the engine polls until the saves report
        release.set()
        settle(e, 10)
        assert _value(metrics.save_chunks) == 3 and _value(metrics.save_queue_depth) == 0
        assert _value(metrics.save_waiting) == 0
        keys = _chunk_keys(e, prompt)
        assert backend.exists([_conn(e).client.keys.object_key(k, 0) for k in keys]) == [True] * 3
    finally:
        release.set()
        e.close()


def test_chunks_the_gpu_cache_reuses_before_a_slot_frees_are_lost_whole_chains_only(
    tiny_llama_dir, weights_cache_dir
):
    """One save slot, writes held: A's last two chunks wait; B then needs every block of a
    48-block cache, so A's waiting chunks are evicted before the slot frees: counted lost
    (one evicted, one behind it), never sent; B's own chunks wait and are saved."""
    import threading

    from kvpool.local_backend import LocalBackend

    release = threading.Event()

    class SlowBackend(LocalBackend):
        def put_from(self, keys, ptrs, sizes, group_ids):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().put_from(keys, ptrs, sizes, group_ids)

    cfg = EngineConfig(cache_dir=weights_cache_dir, num_blocks=68, max_num_batched_tokens=1024)
    e = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
    backend = SlowBackend(BackendConfig("127.0.0.1", "local-slow-evict"))
    metrics = _connect(e, backend, e.namespace, buffer_bytes=None, max_save_chunks=1)
    try:
        a, b = _prompt(8, 800), _prompt(9, 1060)
        e.generate([a], GREEDY)
        assert _value(metrics.save_waiting) == 2
        e.generate([b], GREEDY)  # 67 blocks: A's free blocks are all reused
        assert _value(metrics.save_lost, instance="test", reason="evicted") == 1
        assert _value(metrics.save_lost, instance="test", reason="chain") == 1
        release.set()
        settle(e, 10)
        conn = _conn(e)
        held = backend.exists([conn.client.keys.object_key(k, 0) for k in _chunk_keys(e, a)])
        assert held == [True, False, False]
        held = backend.exists([conn.client.keys.object_key(k, 0) for k in _chunk_keys(e, b)])
        assert held == [True] * 4
        assert _value(metrics.save_dropped) == 0
    finally:
        release.set()
        e.close()


def test_pool_lookup_never_blocks_the_engine_thread(tiny_llama_dir, weights_cache_dir):
    """A pool whose existence checks hang: the request that needs a lookup waits (in the
    waiting queue, the engine thread free), a short request behind it runs to the end;
    once the lookup is back the first one runs too."""
    import threading

    from kvpool.local_backend import LocalBackend

    release = threading.Event()

    class SlowLookups(LocalBackend):
        def exists(self, keys):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().exists(keys)

    cfg = EngineConfig(cache_dir=weights_cache_dir, num_blocks=256, max_num_batched_tokens=1024)
    e = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
    _connect(
        e,
        SlowLookups(BackendConfig("127.0.0.1", "local-slow-lookups")),
        e.namespace,
        buffer_bytes=None,
        max_save_chunks=4,
    )
    try:
        long_id = e.add_request(_prompt(8, 600), GREEDY, "long")
        short_id = e.add_request(_prompt(9, 100), GREEDY, "short")  # < 1 chunk: no lookup
        done: set[str] = set()
        t0 = time.monotonic()
        while short_id not in done:
            assert time.monotonic() - t0 < 30
            done |= {o.request_id for o in e.step() if o.finished}
        assert long_id not in done and e.scheduler.waiting[0].request_id == long_id
        release.set()
        while e.has_unfinished():
            assert time.monotonic() - t0 < 60
            done |= {o.request_id for o in e.step() if o.finished}
        assert long_id in done
    finally:
        release.set()
        e.close()


def test_unpack_chunks_equals_unpack_blocks_per_chunk():
    """The grouped unpack (one index_put per layer for several chunks, from strided
    payload views as the GPU restore's staging holds them) writes what one unpack_blocks
    per chunk writes, and nothing else."""
    import torch

    from prefill_worker.pool_pack import pack_blocks, unpack_blocks, unpack_chunks

    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(2, 64, 16, 2, 8, generator=g) for _ in range(3)]
    blocks = torch.randperm(64, generator=g)[:48].tolist()  # 3 chunks of 16 blocks
    staging = torch.zeros(3, 3 * 2 * 256 * 2 * 8 + 40)  # payloads with a gap between them
    payloads = staging[:, : 3 * 2 * 256 * 2 * 8].view(3, 3, 2, 256, 2, 8)
    for c in range(3):
        pack_blocks(layers, blocks[16 * c : 16 * (c + 1)], payloads[c])
    dst = [torch.randn(2, 64, 16, 2, 8, generator=g) for _ in range(3)]
    want = [x.clone() for x in dst]
    target = torch.randperm(64, generator=g)[:48].tolist()
    for c in range(3):
        unpack_blocks(payloads[c], want, target[16 * c : 16 * (c + 1)])
    unpack_chunks(payloads, dst, target)
    for a, b in zip(want, dst, strict=True):
        assert torch.equal(a, b)

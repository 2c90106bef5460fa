"""Saves that wait for a slot (prefill_worker/pool_save_queue.py) on a real pool (master +
two store services over tcp on loopback): a prefill whose buffer has ONE save slot takes
a burst of long prompts at once; every chunk they computed reaches the pool (none dropped,
none lost: the waiting ones are packed from the GPU prefix cache after their requests
finished), and another engine restores every prompt from it, token for token equal to a
cold run. With pool.save "victim" nothing is saved while the GPU cache holds it, and
what the cache evicts is saved then and restored later."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from pool_harness import Pool, start_pool
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.stats import StageCounters
from prefill_worker.pool_connector import PoolScheduler, PoolWorker
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)
CHUNK = 256
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    p = start_pool(tmp_path_factory.mktemp("pool"), store_sizes=("16MiB", "16MiB"))
    yield p
    p.stop()


def _engine(
    model: Path,
    cache_dir: str,
    pool: Pool | None,
    *,
    num_blocks: int = 512,
    save_mode: str = "through",
    max_save_chunks: int = 1,
) -> tuple[LLMEngine, PoolMetrics]:
    cfg = EngineConfig(cache_dir=cache_dir, num_blocks=num_blocks, max_num_batched_tokens=1024)
    e = LLMEngine.from_spec(str(model), cfg)
    metrics = PoolMetrics(CollectorRegistry(), "test")
    if pool is not None:
        backend = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
        namespace = msgspec.structs.replace(e.namespace, layer_split=(1, 1, 1))
        counters = StageCounters()
        # buffer_bytes None: the least buffer that holds max_save_chunks to save.
        client = PoolClient(
            backend,
            namespace,
            e.layout,
            buffer_bytes=None if max_save_chunks == 1 else 8 << 20,
            max_save_chunks=max_save_chunks,
            metrics=counters,
        )
        assert len(client.buffer.save_slot_ids) == 3 * max_save_chunks
        worker = PoolWorker(client, counters)
        sched = PoolScheduler(client, metrics, 16, wake=worker.wake, save_mode=save_mode)
        e.set_kv_connector(sched, worker)
    return e, metrics


def _settle(e: LLMEngine, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while e.has_unfinished():
        assert time.monotonic() < deadline, "the pool connector did not settle"
        e.step()


def _value(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return float(metric.labels(**labels)._value.get() if labels else metric._value.get())


def test_one_save_slot_loses_no_chunk_of_a_burst(
    tiny_llama_dir: Path, weights_cache_dir: str, pool: Pool
) -> None:
    a, ma = _engine(tiny_llama_dir, weights_cache_dir, pool)
    b, mb = _engine(tiny_llama_dir, weights_cache_dir, pool)
    cold, _ = _engine(tiny_llama_dir, weights_cache_dir, None)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(100, 40000) for _ in range(1000)] for _ in range(5)]
        first = a.generate(prompts, GREEDY)  # 15 full chunks, computed 3 or 4 a step
        assert _value(ma.save_deferred) >= 10  # one slot: most chunks had to wait
        _settle(a)
        assert _value(ma.save_chunks) == 15
        write = ma.save_phase_seconds.labels(instance="test", stage="0", phase="write")
        assert write._value.get() > 0  # where the save thread's time went
        assert _value(ma.save_dropped) == 0
        for reason in ("evicted", "chain"):
            assert _value(ma.save_lost, instance="test", reason=reason) == 0
        again = b.generate(prompts, GREEDY)
        _settle(b)
        want = cold.generate(prompts, GREEDY)
        for x, y, z in zip(first, again, want, strict=True):
            assert y.num_pool_tokens == 3 * CHUNK and y.num_cached_tokens == 0
            assert x.token_ids == y.token_ids == z.token_ids
        assert _value(mb.restored_tokens) == 15 * CHUNK
    finally:
        for e in (a, b, cold):
            e.close()


def test_victim_saves_what_the_gpu_cache_evicts_and_restores_it(
    tiny_llama_dir: Path, weights_cache_dir: str, pool: Pool
) -> None:
    """A 64-block GPU cache holds one 800-token session: A is saved only when B evicts
    it (at B's admission, packed before B's forward overwrites the blocks); A then
    comes back from the pool (and from the 13 blocks the cache kept), equal to a cold
    run, and evicts B, which is saved in turn."""
    e, m = _engine(
        tiny_llama_dir,
        weights_cache_dir,
        pool,
        num_blocks=64,
        save_mode="victim",
        max_save_chunks=4,
    )
    cold, _ = _engine(tiny_llama_dir, weights_cache_dir, None)
    try:
        rng = random.Random(11)
        a, b = ([rng.randrange(100, 40000) for _ in range(800)] for _ in range(2))
        first = e.generate([a], GREEDY)[0]
        _settle(e)
        assert _value(m.save_chunks) == 0  # the GPU cache holds all of A
        first_b = e.generate([b], GREEDY)[0]
        _settle(e)
        assert _value(m.save_chunks) == 3  # A's three chunks, as B evicted them
        again = e.generate([a], GREEDY)[0]
        _settle(e)
        assert again.num_pool_tokens > 0
        assert again.num_cached_tokens + again.num_pool_tokens == 3 * CHUNK
        assert again.token_ids == first.token_ids == cold.generate([a], GREEDY)[0].token_ids
        assert _value(m.save_chunks) == 6  # B's, as A's second turn evicted them
        # B's were packed before A's restore wrote into the same blocks: B restores
        # exactly.
        again_b = e.generate([b], GREEDY)[0]
        _settle(e)
        assert again_b.num_pool_tokens > 0
        assert again_b.token_ids == first_b.token_ids == cold.generate([b], GREEDY)[0].token_ids
        assert _value(m.save_lost, instance="test", reason="evicted") == 0
    finally:
        e.close()
        cold.close()

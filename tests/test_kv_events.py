"""Worker KV events (enginehost/kv_events.py): GET /info and GET /kv_events on a real tiny
engine. The router must be able to rebuild the instance's prefix cache from them with the
hash chain it computes itself."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from enginehost.host import EngineHost
from enginehost.kv_events import ComputeRate, KVReporter
from protocol.hashing import hash_chain, namespace_seed
from protocol.ids import ChunkKey
from protocol.kv_events import KVEventBatch, WorkerInfo
from protocol.sampling import SamplingParams
from router.kv_index import PrefixIndex

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture
def worker(tiny_llama_dir: Path, weights_cache_dir: str):
    engine = LLMEngine.from_spec(
        str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir, num_blocks=24)
    )
    host = EngineHost(engine)
    reporter = KVReporter("p0", "prefill", host, record_block_events=True)
    app = FastAPI()
    reporter.install(app)

    @app.on_event("startup")
    async def _start() -> None:
        host.start()

    with TestClient(app) as client:
        yield engine, host, reporter, client
    host.stop()


def _poll(client: TestClient, since: int, epoch: str) -> KVEventBatch:
    r = client.get("/kv_events", params={"since": since, "epoch": epoch})
    assert r.status_code == 200
    return msgspec.json.decode(r.content, type=KVEventBatch)


def test_events_rebuild_the_prefix_cache(worker) -> None:
    engine, host, reporter, client = worker
    info = msgspec.json.decode(client.get("/info").content, type=WorkerInfo)
    assert info.namespace_key == engine.namespace.key() and info.block_size == 16
    assert info.kv_capacity_tokens == 24 * 16
    root = namespace_seed(info.namespace_key)

    index = PrefixIndex()
    first = _poll(client, 0, "")
    assert first.reset and first.snapshot == []
    index.reset(first.snapshot)
    seq, epoch = first.next_seq, first.epoch

    a = _prompt(100, 1)  # 6 full blocks
    host.loop.submit(lambda e: e.generate([a], PARAMS)).result(timeout=60)
    batch = _poll(client, seq, epoch)
    assert not batch.reset
    for ev in batch.events:
        index.apply(ev.kind, ev.hashes)
    seq = batch.next_seq
    chain = hash_chain(a, info.block_size, root)
    assert index.match_blocks(chain) == 6
    assert batch.load.compute_tokens_per_s is None or batch.load.compute_tokens_per_s > 0

    # Fill the 24-block cache with other prompts: a's blocks are evicted (removed events).
    for s in range(2, 6):
        p = _prompt(200, s)
        host.loop.submit(lambda e, p=p: e.generate([p], PARAMS)).result(timeout=60)
    batch = _poll(client, seq, epoch)
    for ev in batch.events:
        index.apply(ev.kind, ev.hashes)
    want = set(engine.pool.cached_hashes())
    assert index.blocks == want
    assert index.match_blocks(chain) == 0

    # A consumer from another epoch (a restarted worker) gets the snapshot.
    again = _poll(client, seq, "other")
    assert again.reset and set(again.snapshot) == want

    reporter.record_pool_saved([ChunkKey(b"k" * 16)])
    batch = _poll(client, batch.next_seq, epoch)
    assert [(e.kind, e.hashes) for e in batch.events] == [("pool_saved", [b"k" * 16])]
    reporter.record_pool_removed([ChunkKey(b"k" * 16)])
    batch = _poll(client, batch.next_seq, epoch)
    assert [(e.kind, e.hashes) for e in batch.events] == [("pool_removed", [b"k" * 16])]

    host.loop.submit(lambda e: e.reset_prefix_cache()).result(timeout=10)
    batch = _poll(client, batch.next_seq, epoch)
    for ev in batch.events:
        index.apply(ev.kind, ev.hashes)
    assert index.blocks == set()


def test_restore_rate_is_an_ewma(worker) -> None:
    _, _, reporter, client = worker
    reporter.record_restore(1000, 1.0)
    reporter.record_restore(2000, 1.0)
    assert _poll(client, 0, "").load.restore_bytes_per_s == pytest.approx(1200.0)


def test_compute_rate_needs_busy_time() -> None:
    rate = ComputeRate()
    assert rate.sample(0, 0.0) is None
    assert rate.sample(100, 0.1) is None  # under MIN_BUSY_S
    assert rate.sample(1000, 1.0) == pytest.approx(1000.0)
    assert rate.sample(1000, 1.0) == pytest.approx(1000.0)  # idle: the last rate holds

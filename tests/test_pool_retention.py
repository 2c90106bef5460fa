"""Client-side pool retention (kvpool/retention.py, pool.retention: client): the policy on
its own, its budget from cluster.yaml, and the engine with a GPU cache of a few blocks on
a real pool (master + two stores over tcp on loopback): sessions whose history the GPU
cache evicted are restored from the pool as far as the budget keeps them, least recently
used sessions lose their tails first, and outputs equal a cold run's."""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from pool_harness import Pool, start_pool
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from kvpool.retention import LruChainRetention, Retention
from kvpool.stats import StageCounters
from kvpool.topology import retention_share_bytes
from prefill_worker.pool_connector import PoolScheduler, PoolWorker, build_retention
from protocol.cluster import load_cluster, parse_cluster
from protocol.config_errors import ConfigError
from protocol.hashing import chunk_keys, hash_chain, namespace_seed
from protocol.ids import ChunkKey
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parent.parent
CHUNK = 256
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _k(name: str) -> ChunkKey:
    return ChunkKey(name.encode())


# -- the policy ---------------------------------------------------------------------------------
def test_least_recent_chain_loses_its_tail_first() -> None:
    r = LruChainRetention(7, protect_s=0.0, low_water=1.0)
    for stamp, chain in ((1.0, "A"), (2.0, "B"), (3.0, "C")):
        for depth in range(3):
            r.saved(_k(f"{chain}{depth}"), depth, stamp)
    assert r.num_chunks == 9
    assert r.victims() == [_k("A2"), _k("A1")]  # A keeps its first chunk: still a prefix
    assert r.num_chunks == 7 and r.victims() == []


def test_a_use_refreshes_the_whole_chain() -> None:
    r = LruChainRetention(4, protect_s=0.0, low_water=1.0)
    for stamp, chain in ((1.0, "A"), (2.0, "B")):
        for depth in range(2):
            r.saved(_k(f"{chain}{depth}"), depth, stamp)
    r.used([_k("A0"), _k("A1"), _k("X9")], 0, 5.0)  # X9 was never saved here: ignored
    r.saved(_k("A2"), 2, 5.0)  # A's next turn: its new chunk, same stamp
    assert r.victims() == [_k("B1")]


def test_recently_used_chunks_are_protected() -> None:
    r = LruChainRetention(1, protect_s=60.0, low_water=1.0)
    r.saved(_k("A0"), 0, 1.0)
    r.saved(_k("B0"), 0, 2.0)
    assert r.victims() == []  # both used just now: a load may be reading them
    import time

    assert r.victims(now=time.monotonic() + 61) == [_k("A0")]


def test_missing_chunks_are_forgotten() -> None:
    r = LruChainRetention(2, protect_s=0.0)
    r.saved(_k("A0"), 0, 1.0)
    assert r.missing(_k("A0")) and not r.missing(_k("A0"))
    assert r.num_chunks == 0
    assert not Retention().missing(_k("A0")) and Retention().victims() == []


# -- configuration ------------------------------------------------------------------------------
def _cluster(**pool: Any) -> dict[str, Any]:
    d = yaml.safe_load((REPO / "deploy" / "examples" / "local-pd.yaml").read_text())
    d["pool"].update(pool)
    return d


def test_single_gpu_example_uses_client_retention() -> None:
    c = load_cluster(REPO / "deploy" / "examples" / "single-gpu.yaml")
    assert c.pool is not None and c.pool.retention == "client"
    (store,) = c.pool.stores
    assert retention_share_bytes(c, "prefill-0") == int(int(store.size) * c.pool.retention_budget)


def test_budget_is_shared_among_the_writers() -> None:
    d = _cluster(retention="client", retention_budget=0.8)
    extra = copy.deepcopy(d["prefill"][0])
    extra.update(name="prefill-extra", port=extra["port"] + 50)
    d["prefill"].append(extra)
    c = parse_cluster(d)
    assert c.pool is not None
    total = sum(int(s.size) for s in c.pool.stores)
    assert retention_share_bytes(c, "prefill-extra") == int(total * 0.8) // 2
    assert c.pool.retention == "client"
    assert parse_cluster(_cluster()).pool.retention == "mooncake"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [0.0, 0.95, -1])
def test_budget_above_the_watermark_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"pool\.retention_budget"):
        parse_cluster(_cluster(retention="client", retention_budget=bad))


def test_save_mode_is_through_unless_victim_is_asked() -> None:
    assert parse_cluster(_cluster()).pool.save == "through"  # type: ignore[union-attr]
    assert parse_cluster(_cluster(save="victim")).pool.save == "victim"  # type: ignore[union-attr]
    single = load_cluster(REPO / "deploy" / "examples" / "single-gpu.yaml")
    assert single.pool is not None and single.pool.save == "through"
    with pytest.raises(ConfigError, match=r"pool\.save"):
        parse_cluster(_cluster(save="evict"))


# -- the engine on a real pool ------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    # 2 x 16 MiB: ~80 chunks of the tiny model, far more than the budget below, so the
    # master never evicts and every removal is the client's.
    p = start_pool(tmp_path_factory.mktemp("pool"), store_sizes=("16MiB", "16MiB"))
    yield p
    p.stop()


def _engine(model: Path, cache_dir: str, num_blocks: int) -> LLMEngine:
    cfg = EngineConfig(cache_dir=cache_dir, num_blocks=num_blocks, max_num_batched_tokens=1024)
    return LLMEngine.from_spec(str(model), cfg)


def _settle(e: LLMEngine) -> None:
    import time

    deadline = time.monotonic() + 30
    while e.has_unfinished():
        assert time.monotonic() < deadline, "the pool connector did not settle"
        e.step()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_evicted_history_comes_back_from_the_pool_as_the_budget_promises(
    tiny_llama_dir: Path, weights_cache_dir: str, pool: Pool
) -> None:
    """GPU cache of 64 blocks (one 800-token session at a time), a budget of 7 chunks:
    after sessions A, B, C (3 chunks each) A keeps its first chunk, B and C all three;
    run again, each restores exactly that from the pool (its GPU copy is gone)."""
    e = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=64)
    cold = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=512)
    backend = create_backend("mooncake", BackendConfig("127.0.0.1", pool.master_address))
    namespace = msgspec.structs.replace(e.namespace, layer_split=(1, 1, 1))
    counters = StageCounters()
    client = PoolClient(
        backend, namespace, e.layout, buffer_bytes=4 << 20, max_save_chunks=8, metrics=counters
    )
    metrics = PoolMetrics(CollectorRegistry(), "test")
    worker = PoolWorker(client, counters)
    retention = LruChainRetention(7, protect_s=0.0, low_water=1.0)
    sched = PoolScheduler(client, metrics, 16, wake=worker.wake, retention=retention)
    e.set_kv_connector(sched, worker)
    try:
        prompts = {name: _prompt(seed, 800) for seed, name in enumerate("ABC", 40)}
        firsts = {}
        for name in "ABC":
            firsts[name] = e.generate([prompts[name]], GREEDY)[0]
            _settle(e)
            assert firsts[name].num_pool_tokens == 0
        assert metrics.save_chunks._value.get() == 9
        assert metrics.retention_removed._value.get() == 2
        assert metrics.retained_chunks._value.get() == 7

        def held(name: str) -> list[bool]:
            root = namespace_seed(e.namespace.key())  # the engine's block hashes
            keys = chunk_keys(hash_chain(prompts[name], 16, root), CHUNK // 16)
            objs = [
                client.keys.object_key(ChunkKey(bytes(k)), s.index)
                for k in keys
                for s in client.stages
            ]
            found = backend.exists(objs)
            return [all(found[i * 3 : i * 3 + 3]) for i in range(len(keys))]

        assert held("A") == [True, False, False]  # tail first: A's prefix stays usable
        assert held("B") == [True, True, True] and held("C") == [True, True, True]
        # B, then A: neither is in the 64-block GPU cache any more (C pushed them out).
        again_b = e.generate([prompts["B"]], GREEDY)[0]
        _settle(e)
        # (the GPU may still hold B's first blocks: blocks are freed tail first)
        assert again_b.num_pool_tokens > CHUNK
        assert again_b.num_cached_tokens + again_b.num_pool_tokens == 3 * CHUNK
        for stage in ("0", "1", "2"):  # where the restores' time went, by phase
            for phase in ("read", "check", "unpack"):
                got = metrics.restore_phase_seconds.labels(
                    instance="test", stage=stage, phase=phase
                )._value.get()
                assert got > 0, (stage, phase)
        again_a = e.generate([prompts["A"]], GREEDY)[0]
        _settle(e)
        assert again_a.num_cached_tokens == 0 and again_a.num_pool_tokens == CHUNK
        for name, out in (("A", again_a), ("B", again_b)):
            want = cold.generate([prompts[name]], GREEDY)[0].token_ids
            assert out.token_ids == firsts[name].token_ids == want
        # A's turn saved its chunks 1-2 again; C, now the least recent, lost its tail.
        assert held("A") == [True, True, True] and held("C") == [True, False, False]
        assert metrics.retention_removed._value.get() == 4
    finally:
        e.close()
        cold.close()


def test_build_retention_follows_the_cluster(tiny_llama_dir: Path, weights_cache_dir: str) -> None:
    from kvpool.local_backend import LocalBackend

    e = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=64)
    try:
        client = PoolClient(
            LocalBackend(BackendConfig("127.0.0.1", "local-retention")),
            e.namespace,
            e.layout,
            buffer_bytes=None,
            max_save_chunks=1,
            metrics=StageCounters(),
        )
        on = parse_cluster(_cluster(retention="client", retention_budget=0.5))
        r = build_retention(on, on.prefill[0], client)
        chunk_bytes = sum(s.object_bytes for s in client.specs.values())
        assert isinstance(r, LruChainRetention)
        assert r.budget == retention_share_bytes(on, on.prefill[0].name) // chunk_bytes
        off = parse_cluster(_cluster())
        assert type(build_retention(off, off.prefill[0], client)) is Retention
        client.close()
    finally:
        e.close()

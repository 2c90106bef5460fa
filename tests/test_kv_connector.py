"""The engine's KVConnector seam with an in-memory connector: async loads while other
requests run, partial and failed loads recompute, aborts during a load, token accounting
(gpu + pool + computed = prompt), a restoring burst larger than the cache admitted whole
(engine/admission.py), and output identical to a cold run."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
import torch

from engine.config import EngineConfig
from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.kv_connector_guard import KVConnectorGuard
from engine.llm_engine import LLMEngine
from engine.request import Request
from protocol.hashing import chunk_keys
from protocol.ids import RequestId
from protocol.sampling import SamplingParams
from transfer.kv_pack import gather, scatter

CHUNK = 256
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class DictScheduler(KVConnectorScheduler):
    """Scheduler side: chunk lookups in the shared dict; plans loads and saves as msgpack
    [loads, saves] (the worker side runs them). Loads are done when the worker says."""

    def __init__(self, store: dict[bytes, torch.Tensor]) -> None:
        self.store = store
        self._loads: list[list] = []
        self._in_flight: set[str] = set()
        self._finished_in_flight: set[str] = set()
        self._saved_upto: dict[RequestId, int] = {}
        self.finished: list[RequestId] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        keys = _keys(request)
        last = min((request.num_tokens - 1) // CHUNK, request.num_prompt_tokens // CHUNK)
        c = num_computed_tokens // CHUNK
        while c < last and keys[c] in self.store:
            c += 1
        return max(0, c * CHUNK - num_computed_tokens), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        if num_external_tokens:
            start = request.num_computed_tokens
            self._loads.append(
                [
                    request.request_id,
                    _keys(request),
                    list(block_ids),
                    start,
                    start + num_external_tokens,
                ]
            )
            self._in_flight.add(request.request_id)

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        saves = []
        for kv in computed:
            r = kv.request
            c = self._saved_upto.setdefault(r.request_id, kv.token_start // CHUNK)
            last = min(kv.token_end, r.num_prompt_tokens) // CHUNK
            if c < last:
                saves.append([_keys(r)[c:last], c, list(kv.block_ids)])
                self._saved_upto[r.request_id] = last
        if not (self._loads or saves):
            return b""
        loads, self._loads = self._loads, []
        return msgspec.msgpack.encode([loads, saves])

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        out = ConnectorUpdate()
        for raw in reports:
            for rid, n in msgspec.msgpack.decode(raw) if raw else []:
                self._in_flight.discard(rid)
                if rid in self._finished_in_flight:
                    self._finished_in_flight.discard(rid)
                    out.released.add(rid)
                else:
                    out.finished_loads[rid] = n
        return out

    def request_finished(self, request: Request, block_ids) -> bool:
        self._saved_upto.pop(request.request_id, None)
        self.finished.append(request.request_id)
        if request.request_id in self._in_flight:
            self._finished_in_flight.add(request.request_id)
            return True
        return False

    def has_pending(self) -> bool:
        return bool(self._in_flight)


class DictWorker(KVConnectorWorker):
    """Worker side: loads on a thread (`fail_from_chunk`: they stop there, a partial load;
    `gate`: they wait for it), saves copied in start_saves."""

    def __init__(self, store: dict[bytes, torch.Tensor]) -> None:
        self.store = store
        self.fail_from_chunk: int | None = None
        self.gate = threading.Event()
        self.gate.set()
        self._done: list[list] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.kv_caches: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches, place: WorkerPlace) -> None:
        self.kv_caches = kv_caches

    def start_loads(self, meta: bytes) -> None:
        for rid, keys, table, token_start, token_end in (
            msgspec.msgpack.decode(meta)[0] if meta else []
        ):
            threading.Thread(
                target=self._load, args=(rid, keys, table, token_start, token_end), daemon=True
            ).start()

    def _load(self, rid, keys, table, token_start, token_end) -> None:  # type: ignore[no-untyped-def]
        self.gate.wait(10)
        n = token_start
        for c in range(token_start // CHUNK, token_end // CHUNK):
            if self.fail_from_chunk is not None and c >= self.fail_from_chunk:
                break
            lo = max(token_start, c * CHUNK)
            src = self.store[keys[c]][:, :, lo - c * CHUNK :]
            scatter(src, self.kv_caches, table, lo, (c + 1) * CHUNK)
            n = (c + 1) * CHUNK
        with self._lock:
            self._done.append([rid, n - token_start])
        self._wake.set()

    def start_saves(self, meta: bytes) -> None:
        for keys, c0, table in msgspec.msgpack.decode(meta)[1] if meta else []:
            for i, key in enumerate(keys):
                c = c0 + i
                k0 = self.kv_caches[0]
                out = torch.empty(
                    (len(self.kv_caches), 2, CHUNK, k0.shape[3], k0.shape[4]), dtype=k0.dtype
                )
                gather(self.kv_caches, table, c * CHUNK, (c + 1) * CHUNK, out)
                self.store.setdefault(key, out)

    def get_finished(self) -> bytes:
        with self._lock:
            done, self._done = self._done, []
        return msgspec.msgpack.encode(done) if done else b""

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()


def _keys(req: Request) -> list[bytes]:
    return [bytes(k) for k in chunk_keys(req.block_hashes, CHUNK // 16)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, weights_cache_dir: str):
    cfg = EngineConfig(cache_dir=weights_cache_dir, num_blocks=256, max_num_batched_tokens=512)
    store: dict[bytes, torch.Tensor] = {}
    made = []
    for _ in range(2):
        e = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
        e.set_kv_connector(DictScheduler(store), DictWorker(store))
        made.append(e)
    cold = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
    return made[0], made[1], cold, store


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _worker(e: LLMEngine) -> DictWorker:
    assert isinstance(e.kv_worker, KVConnectorGuard)  # engine/kv_connector_guard.py
    assert isinstance(e.kv_worker.inner, DictWorker)
    return e.kv_worker.inner


def _reset(e: LLMEngine) -> None:
    e.reset_prefix_cache()
    conn = _worker(e)
    conn.fail_from_chunk = None
    conn.gate.set()


def test_second_engine_restores_chunks_and_matches_cold(engines):
    a, b, cold, store = engines
    p = _prompt(1, 700)  # 2 full chunks, the rest computed
    first = a.generate([p], GREEDY)[0]
    assert first.num_pool_tokens == 0 and len(store) >= 2
    _reset(b)
    before = b.counters.prompt_tokens_pool
    got = b.generate([p], GREEDY)[0]
    want = cold.generate([p], GREEDY)[0]
    assert got.token_ids == want.token_ids == first.token_ids
    assert got.num_pool_tokens == 2 * CHUNK and got.num_cached_tokens == 0
    assert b.counters.prompt_tokens_pool - before == 2 * CHUNK
    # Loaded blocks joined b's GPU prefix cache: the same prompt is now a GPU hit.
    again = b.generate([p], GREEDY)[0]
    assert again.num_cached_tokens == (700 - 1) // 16 * 16 and again.num_pool_tokens == 0


def test_gpu_prefix_then_pool_then_compute(engines):
    a, b, cold, _ = engines
    _reset(a)
    _reset(b)
    history = _prompt(2, 600)
    a.generate([history], GREEDY)  # saves chunks 0 and 1
    b.generate([history[:300]], GREEDY)  # b caches 18 blocks (288 tokens) of the prefix
    turn = history + _prompt(3, 50)
    got = b.generate([turn], GREEDY)[0]
    assert got.num_cached_tokens == 288
    assert got.num_pool_tokens == 2 * CHUNK - 288  # the rest of chunk 0, all of chunk 1
    assert got.token_ids == cold.generate([turn], GREEDY)[0].token_ids


def test_partial_load_recomputes_from_first_missing_chunk(engines):
    a, b, cold, _ = engines
    _reset(a)
    _reset(b)
    p = _prompt(4, 1000)  # 3 full chunks
    a.generate([p], GREEDY)
    conn = _worker(b)
    conn.fail_from_chunk = 1
    short = b.counters.loads_short
    got = b.generate([p], GREEDY)[0]
    assert got.num_pool_tokens == CHUNK  # chunk 0 only; chunks 1-2 recomputed
    assert b.counters.loads_short == short + 1
    assert got.token_ids == cold.generate([p], GREEDY)[0].token_ids
    _reset(b)
    conn.fail_from_chunk = 0  # nothing loads: a plain recompute
    got = b.generate([p], GREEDY)[0]
    assert got.num_pool_tokens == 0 and got.token_ids == cold.generate([p], GREEDY)[0].token_ids


def test_others_run_while_one_waits_for_kv_and_abort_keeps_blocks(engines):
    a, b, _, _ = engines
    _reset(a)
    _reset(b)
    p = _prompt(5, 600)
    a.generate([p], GREEDY)
    conn = _worker(b)
    conn.gate.clear()  # the load hangs until the gate opens
    slow = b.add_request(p, GREEDY, "slow")
    fast = b.add_request(_prompt(6, 40), GREEDY, "fast")
    done: set[str] = set()
    for _ in range(20):
        for out in b.step():
            if out.finished:
                done.add(out.request_id)
        if fast in done:
            break
    assert fast in done and slow not in done and slow in b.scheduler.loading
    # Abort while the load is in flight: blocks stay held until the load reports.
    held = b.pool.num_free_blocks
    assert b.abort(slow)
    assert b.pool.num_free_blocks == held and slow in b.scheduler.held
    assert b.has_unfinished()  # the engine keeps polling until the load reports
    conn.gate.set()
    for _ in range(200):
        b.step()
        if not b.scheduler.held:
            break
    assert not b.has_unfinished()
    assert b.pool.num_free_blocks == b.pool.num_blocks


@pytest.mark.parametrize("admission", ["whole_prompt", "chunk"])
def test_a_restoring_burst_larger_than_the_cache_is_admitted_whole(
    engines, tiny_llama_dir: Path, weights_cache_dir: str, admission: str
):
    """Five 600-token prompts whose first two chunks are in the store, at once against
    96 blocks (1536 tokens): whole_prompt admits a prompt (its load into blocks included)
    only beside what the loading and running ones still need; nothing is preempted and
    every prompt restores its chunks and matches a cold run. chunk (the rule before)
    preempts on the same burst."""
    a, _, cold, store = engines
    prompts = [_prompt(60 + i, 600) for i in range(5)]
    a.generate(prompts, GREEDY)  # saves chunks 0 and 1 of each
    cfg = EngineConfig(
        cache_dir=weights_cache_dir,
        num_blocks=96,
        max_num_batched_tokens=256,
        admission=admission,
    )
    c = LLMEngine.from_spec(str(tiny_llama_dir), cfg)
    c.set_kv_connector(DictScheduler(store), DictWorker(store))
    got = c.generate(prompts, GREEDY)
    for p, g in zip(prompts, got, strict=True):
        assert g.token_ids == cold.generate([p], GREEDY)[0].token_ids
    assert [g.num_pool_tokens for g in got] == [2 * CHUNK] * 5
    if admission == "whole_prompt":
        assert c.counters.preemptions == 0 and c.counters.loads_started == 5
    else:  # the rule before: a prompt started beside the loads is preempted, loaded again
        assert c.counters.preemptions > 0 and c.counters.loads_started > 5
    c.close()

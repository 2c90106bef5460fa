"""A prefill instance's admission rule (engine/admission.py) on the real engine with a tiny
random Llama: a burst of prompts larger than the cache, each finished prompt's blocks held
for its handoff like prefill_worker/handoff.py does, is computed without a preemption and
every first token equals a run without pressure; with `chunk` the same burst preempts;
a prompt as large as the whole cache waits and finishes; a larger one is refused; only
prefill instances take cache.prefill_admission."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest

from engine.config import EngineConfig
from engine.kv_connector import ConnectorUpdate, NoConnectorScheduler, NoConnectorWorker
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from enginehost.host import EngineHost
from enginehost.metrics import EngineCollector
from enginehost.startup import engine_config
from prefill_worker.stages import stage_engine_config
from protocol.cluster import load_cluster
from protocol.errors import PromptTooLongError
from protocol.ids import BlockId, RequestId
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class HeldHandoff(NoConnectorScheduler):
    """Keeps a finished request's blocks as a prefill instance's handoff does while decode
    reads them: one transfer after the other, each `steps` engine steps long."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.now = 0
        self._release_at: dict[RequestId, int] = {}
        self._last = 0

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        self.now += 1
        done = {r for r, at in self._release_at.items() if at <= self.now}
        for r in done:
            del self._release_at[r]
        return ConnectorUpdate(released=done)

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        if request.status is RequestStatus.WAITING or not block_ids:
            return False  # preempted (nothing was sent) or nothing to send
        self._last = max(self.now, self._last) + self.steps
        self._release_at[request.request_id] = self._last
        return True

    def has_pending(self) -> bool:
        return bool(self._release_at)


class _NoWait(NoConnectorWorker):
    def wait(self, timeout_s: float) -> None:
        return None  # the held blocks come back by steps, not by time


def _engine(model: Path, cache_dir: str, admission: str, **kw: object) -> LLMEngine:
    cfg = EngineConfig(cache_dir=cache_dir, admission=admission, **kw)  # type: ignore[arg-type]
    return LLMEngine.from_spec(str(model), cfg)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _prefill(eng: LLMEngine, prompts: list[list[int]]) -> list[int]:
    """Run prompts as a prefill instance does (each leaves at its first token); returns
    those tokens in prompt order, once every held block came back."""
    ids = [eng.add_request(p, GREEDY, prefill_only=True) for p in prompts]
    first: dict[str, int] = {}
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.error is None
            if out.new_token_ids:
                first[out.request_id] = out.new_token_ids[0]
    assert not eng.has_unfinished(), "the engine made no progress"
    return [first[r] for r in ids]


def _scraped(eng: LLMEngine, name: str) -> float:
    """The value an engine host's /metrics would show (enginehost/metrics.py)."""
    host = cast(EngineHost, SimpleNamespace(engine=eng))
    for family in EngineCollector(host, "prefill-0", "prefill", 1).collect():
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(f"{name} is not exported")


@pytest.fixture(scope="module")
def unpressed(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    """Reference: a cache far larger than any burst here, nothing held."""
    return _engine(tiny_llama_dir, weights_cache_dir, "chunk", enable_prefix_caching=False)


@pytest.mark.parametrize("order", ["shortest", "fcfs"])
def test_a_burst_larger_than_the_cache_runs_without_preemption(
    tiny_llama_dir: Path, weights_cache_dir: str, unpressed: LLMEngine, order: str
) -> None:
    """16 prompts of 100..160 tokens (~2000, 7..10 blocks of 16) at once against 48
    blocks (768 tokens), 192 tokens a step, every finished prompt's blocks held for 3
    steps: whole_prompt never preempts and computes every prompt token once; chunk, the
    rule before, preempts and computes some twice. The first tokens equal the reference's
    either way, and whole_prompt takes no more engine steps."""
    rng = random.Random(7)
    prompts = [_prompt(rng.randint(100, 160), 300 + i) for i in range(16)]
    want = [unpressed.generate([p], GREEDY)[0].token_ids[0] for p in prompts]
    counters, steps, deferred = {}, {}, {}
    for admission in ("whole_prompt", "chunk"):
        eng = _engine(
            tiny_llama_dir,
            weights_cache_dir,
            admission,
            num_blocks=48,
            max_num_batched_tokens=192,
            prefill_order=order,
        )
        eng.set_kv_connector(HeldHandoff(steps=3), _NoWait())
        assert _prefill(eng, prompts) == want
        assert eng.pool.num_free_blocks == eng.pool.num_blocks  # every block came back
        counters[admission] = eng.counters
        steps[admission] = eng.scheduler.steps
        deferred[admission] = _scraped(eng, "kvserve_engine_admissions_deferred")
        eng.close()
    whole, chunk = counters["whole_prompt"], counters["chunk"]
    assert whole.preemptions == 0 and whole.recomputed_tokens == 0
    assert whole.prompt_tokens_computed == sum(map(len, prompts))
    assert deferred["whole_prompt"] == whole.admissions_deferred > 0  # exported
    assert deferred["chunk"] == 0
    assert chunk.preemptions > 0 and chunk.recomputed_tokens > 0
    assert steps["whole_prompt"] <= steps["chunk"]  # waiting for blocks cost no steps


def test_a_prompt_the_size_of_the_cache_waits_and_finishes(
    tiny_llama_dir: Path, weights_cache_dir: str, unpressed: LLMEngine
) -> None:
    """Four short prompts and one that needs every block: it waits until they left and
    their blocks came back, then runs alone; one token more is refused at the door."""
    eng = _engine(
        tiny_llama_dir,
        weights_cache_dir,
        "whole_prompt",
        num_blocks=16,
        max_num_batched_tokens=64,
    )
    eng.set_kv_connector(HeldHandoff(steps=2), _NoWait())
    big = _prompt(16 * 16 - GREEDY.max_tokens, 400)  # prompt + max_tokens = the cache
    prompts = [_prompt(40, 401 + i) for i in range(2)] + [big] + [_prompt(40, 403)]
    want = [unpressed.generate([p], GREEDY)[0].token_ids[0] for p in prompts]
    assert _prefill(eng, prompts) == want
    assert eng.counters.preemptions == 0
    with pytest.raises(PromptTooLongError, match="KV cache"):
        eng.add_request([*big, 5], GREEDY, prefill_only=True)
    eng.close()


def test_only_prefill_instances_take_the_prefill_admission() -> None:
    repo = Path(__file__).resolve().parent.parent
    cluster = load_cluster(repo / "deploy" / "examples" / "local-pd.yaml")
    assert cluster.cache.prefill_admission == "whole_prompt"  # the default
    inst = cluster.prefill[0]
    assert stage_engine_config(cluster, inst, 0).admission == "whole_prompt"
    decode = cluster.decode[0]
    cfg = engine_config(
        cluster,
        device=decode.devices[0],
        kv_cache_bytes=int(decode.kv_cache_memory),
        max_num_seqs=decode.max_num_seqs,
    )
    assert cfg.admission == "chunk"  # decode and unified engines
    chunk = msgspec.structs.replace(
        cluster, cache=msgspec.structs.replace(cluster.cache, prefill_admission="chunk")
    )
    assert stage_engine_config(chunk, inst, 0).admission == "chunk"

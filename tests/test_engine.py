"""LLMEngine behaviour on a tiny random Llama: prefix cache, chunking, batching, preemption,
sampling controls. Every comparison is against a cold, unbatched, unchunked run."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, cache_dir: str, **kw) -> LLMEngine:
    return LLMEngine.from_spec(str(model_dir), EngineConfig(cache_dir=cache_dir, **kw))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def cold(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    """Reference engine: prefix caching off, each request run alone and unchunked."""
    return _engine(tiny_llama_dir, weights_cache_dir, enable_prefix_caching=False)


def _alone(eng: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return eng.generate([prompt], params)[0].token_ids


def test_prefix_hit_computes_only_new_tokens(tiny_llama_dir, weights_cache_dir, cold):
    eng = _engine(tiny_llama_dir, weights_cache_dir)
    shared = _prompt(300, 1)
    first = eng.generate([shared + _prompt(7, 2)], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = eng.counters.prompt_tokens_computed
    second_prompt = shared + _prompt(21, 3)
    second = eng.generate([second_prompt], GREEDY)[0]
    # 300 shared tokens = 18 full blocks of 16 (288 tokens) served from cache.
    assert second.num_cached_tokens == 288
    assert eng.counters.prompt_tokens_computed - before == len(second_prompt) - 288
    assert second.token_ids == _alone(cold, second_prompt)


def test_full_prompt_hit_still_computes_last_token(tiny_llama_dir, weights_cache_dir, cold):
    eng = _engine(tiny_llama_dir, weights_cache_dir)
    p = _prompt(64, 4)  # exactly 4 blocks
    a = eng.generate([p], GREEDY)[0]
    b = eng.generate([p], GREEDY)[0]
    assert b.num_cached_tokens == 48  # the last block is recomputed to get its logits
    assert a.token_ids == b.token_ids == _alone(cold, p)


def test_prefix_cache_under_eviction_pressure(tiny_llama_dir, weights_cache_dir, cold):
    eng = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=40)
    shared = _prompt(200, 5)
    eng.generate([[*shared, 7]], GREEDY)
    for i in range(6):  # unrelated traffic evicts the cached free blocks
        eng.generate([_prompt(300, 100 + i)], GREEDY)
    assert eng.pool.num_evictions > 0
    p = shared + _prompt(30, 6)
    out = eng.generate([p], GREEDY)[0]
    assert out.num_cached_tokens < 192  # the shared prefix was (at least partly) evicted
    assert out.token_ids == _alone(cold, p)
    again = eng.generate([p], GREEDY)[0]
    assert again.num_cached_tokens == (len(p) - 1) // 16 * 16
    assert again.token_ids == out.token_ids


@pytest.mark.parametrize("budget", [16, 37, 100])
def test_chunked_prefill_equals_unchunked(tiny_llama_dir, weights_cache_dir, cold, budget):
    eng = _engine(tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=budget)
    prompts = [_prompt(n, 10 + n) for n in (150, 33, 7)]
    outs = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _alone(cold, p)


def test_batch_of_eight_mixed_lengths_equals_alone(tiny_llama_dir, weights_cache_dir, cold):
    eng = _engine(tiny_llama_dir, weights_cache_dir)
    lens = [1, 5, 16, 17, 40, 90, 130, 250]
    prompts = [_prompt(n, 20 + n) for n in lens]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True) for i in range(8)]
    outs = eng.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs, strict=True):
        assert len(o.token_ids) == sp.max_tokens
        assert o.finish_reason == "length"
        assert o.token_ids == _alone(cold, p, sp)


def test_preemption_under_tiny_block_budget(tiny_llama_dir, weights_cache_dir, cold):
    eng = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=24, max_num_batched_tokens=64)
    prompts = [_prompt(60 + 10 * i, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert eng.counters.preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _alone(cold, p, params)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks  # everything released


def test_seeded_sampling_reproducible_across_batches(tiny_llama_dir, weights_cache_dir):
    eng = _engine(tiny_llama_dir, weights_cache_dir)
    p = _prompt(20, 50)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = eng.generate([p], sp)[0].token_ids
    others = [_prompt(30, 51), _prompt(9, 52)]
    noisy = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = eng.generate([others[0], p, others[1]], [noisy, sp, noisy])[1].token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert eng.generate([p], other_seed)[0].token_ids != alone


def test_abort_frees_blocks(tiny_llama_dir, weights_cache_dir):
    eng = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=64)
    rid = eng.add_request(_prompt(100, 60), GREEDY)
    eng.step()
    assert eng.pool.num_free_blocks < 64
    assert eng.abort(rid)
    assert not eng.has_unfinished()
    assert eng.pool.num_free_blocks == 64
    assert not eng.abort(rid)


def test_errors(tiny_llama_dir, weights_cache_dir):
    eng = _engine(tiny_llama_dir, weights_cache_dir, num_blocks=8, max_model_len=1000)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request([5], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.add_request([10**6], GREEDY)
    with pytest.raises(PromptTooLongError, match="maximum context length is 1000"):
        eng.add_request(_prompt(995, 1), GREEDY)
    with pytest.raises(PromptTooLongError, match="KV cache holds 128"):
        eng.add_request(_prompt(200, 1), GREEDY)
    assert not eng.has_unfinished()


def test_warm_up_steps_leave_the_engine_as_it_was(
    tiny_llama_dir: Path, weights_cache_dir: str, cold: LLMEngine, caplog
) -> None:
    """ModelRunner._warm_up (run after graph capture on CUDA, called directly here on the
    CPU runner): its two prefill-shaped steps write KV into blocks no request holds and
    give the device table row back, so requests afterwards get the tokens a cold engine
    gives; a warm-up whose step fails is logged and leaves the runner serving."""
    eng = _engine(tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=512)
    runner = eng.runner
    assert isinstance(runner, ModelRunner)
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        runner._warm_up(512)  # 512 new tokens, then 256 behind them
    assert "prefill warm-up: 512 and 256 new tokens" in caplog.text
    assert runner.tables._rows == {}
    prompts = [_prompt(300, 41), _prompt(90, 42)]
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == [
        _alone(cold, p) for p in prompts
    ]

    def fails(*_a: object) -> None:
        raise RuntimeError("step failed")

    real = runner.execute
    runner.execute = fails  # type: ignore[method-assign]
    caplog.clear()
    runner._warm_up(512)
    runner.execute = real  # type: ignore[method-assign]
    assert "the prefill warm-up failed" in caplog.text
    assert runner.tables._rows == {}
    assert _alone(eng, prompts[0]) == _alone(cold, prompts[0])

"""The GPU engine path on CUDA (pytest -m gpu on the lent GPU machine): the "flex"
attention backend, decode CUDA graphs, device block tables and sampling on the device.

Tiny random float32 models: the flex engine (graphs on and off, layers fused by
torch.compile or not) gives the same greedy
tokens as the torch reference backend, through prefix hits, chunked prefill, mixed
batches and preemption; every sampling parameter works on CUDA. The backend's kernel
conformance runs in tests/test_attention_backends.py (its cuda cases)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import engine.model_runner as model_runner
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protocol.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _engine(path: Path, cache: str, **kw) -> LLMEngine:
    config = EngineConfig(device="cuda", cache_dir=cache, max_num_seqs=8, **kw)
    return LLMEngine.from_spec(str(path), config)


def _runner(eng: LLMEngine) -> ModelRunner:
    assert isinstance(eng.runner, ModelRunner)
    return eng.runner


def _workload(eng: LLMEngine) -> list[list[int]]:
    """Prefix hit, then a mixed batch of varied lengths (chunked by the step budget)."""
    shared = _prompt(200, 1)
    outs = [eng.generate([[*shared, 5]], GREEDY)[0].token_ids]
    hit = eng.generate([shared + _prompt(20, 2)], GREEDY)[0]
    assert hit.num_cached_tokens == 192
    outs.append(hit.token_ids)
    prompts = [_prompt(n, 10 + n) for n in (1, 17, 64, 150, 33)]
    outs += [o.token_ids for o in eng.generate(prompts, GREEDY)]
    return outs


def test_flex_with_and_without_graphs_equals_torch(tiny_llama_dir, weights_cache_dir):
    ref = _workload(_engine(tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=37))
    graphs = _engine(
        tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=37, attention_backend="flex"
    )
    assert _runner(graphs).graphs is not None
    assert _runner(graphs).model.layers[0].ops.fused  # compile_layers: on by default
    assert _workload(graphs) == ref
    unfused = _engine(
        tiny_llama_dir,
        weights_cache_dir,
        max_num_batched_tokens=37,
        attention_backend="flex",
        compile_layers=False,
    )
    assert not _runner(unfused).model.layers[0].ops.fused
    assert _workload(unfused) == ref
    eager = _engine(
        tiny_llama_dir,
        weights_cache_dir,
        max_num_batched_tokens=37,
        attention_backend="flex",
        cuda_graphs=False,
    )
    assert _runner(eager).graphs is None
    assert _workload(eager) == ref


def test_flex_preemption_equals_cold(tiny_llama_dir, weights_cache_dir):
    cold = _engine(tiny_llama_dir, weights_cache_dir, enable_prefix_caching=False)
    tight = _engine(
        tiny_llama_dir,
        weights_cache_dir,
        num_blocks=12,
        max_num_batched_tokens=64,
        attention_backend="flex",
    )
    prompts = [_prompt(60 + 10 * i, 40 + i) for i in range(6)]
    outs = tight.generate(prompts, GREEDY)
    assert tight.counters.preemptions > 0
    for q, o in zip(prompts, outs, strict=True):
        assert o.token_ids == cold.generate([q], GREEDY)[0].token_ids


def test_steady_decode_uploads_one_block_id_per_new_block(tiny_llama_dir, weights_cache_dir):
    eng = _engine(tiny_llama_dir, weights_cache_dir, attention_backend="flex")
    tables = _runner(eng).tables
    before = tables.uploaded_entries  # the start-up warm-up's table
    prompts = [_prompt(300, 7 + i) for i in range(4)]
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    eng.generate(prompts, long)
    # 4 x ceil(364 / 16) = 92 block ids, uploaded once each (the whole 19-block prompt
    # tables on the first step, then one per 16 decode steps), not 4 x ~21 per step.
    assert tables.uploaded_entries - before <= 4 * 23


@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_every_sampling_parameter_on_cuda(backend, tiny_llama_dir, weights_cache_dir):
    eng = _engine(tiny_llama_dir, weights_cache_dir, attention_backend=backend)
    prompt = _prompt(40, 3)
    greedy = eng.generate([prompt], GREEDY)[0].token_ids

    def run(**kw) -> tuple[list[int], list[float | None]]:
        params = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
        out = eng.generate([prompt], params)[0]
        return out.token_ids, out.logprobs

    tokens, _ = run(temperature=1.0)  # unseeded: the shared generator on the device
    assert len(tokens) == 12
    assert run(temperature=0.8, top_k=1)[0] == greedy  # top-k 1 is greedy
    assert run(temperature=0.8, top_p=1e-6)[0] == greedy  # a nucleus of one token
    seeded = run(temperature=1.0, seed=123, top_k=50, top_p=0.9)
    assert seeded == run(temperature=1.0, seed=123, top_k=50, top_p=0.9)  # reproducible
    assert run(temperature=1.0, seed=124)[0] != run(temperature=1.0, seed=123)[0]
    tokens, logprobs = run(temperature=0.0, logprobs=True)
    assert tokens == greedy
    assert all(lp is not None and -50 < lp <= 0 and math.isfinite(lp) for lp in logprobs)
    # A batch mixing all of them samples each row by its own parameters.
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=5, logprobs=True),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.2, top_k=3),
    ]
    outs = [eng.generate([prompt], p)[0] for p in params]
    batch = eng.generate([prompt] * 3, params)
    assert batch[0].token_ids == greedy
    assert batch[1].token_ids == outs[1].token_ids  # seeded: independent of the batch


def test_decode_ahead_on_cuda_equals_off(tiny_llama_dir, weights_cache_dir):
    """Decode steps launched ahead on CUDA (graphs, compiled layers, the tokens fed on the
    device): requests finishing at different lengths, seeded sampling and logprobs give
    the same tokens and logprobs as the engine that waits for each step's tokens, and the
    launched steps are used."""
    prompts = [_prompt(n, 60 + n) for n in (5, 40, 130, 17)]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=33, temperature=1.1, seed=3, top_k=20, ignore_eos=True),
    ]
    outs = {}
    for ahead in (False, True):
        eng = _engine(
            tiny_llama_dir, weights_cache_dir, attention_backend="flex", decode_ahead=ahead
        )
        outs[ahead] = eng.generate(prompts, params)
        if ahead:
            assert _runner(eng).ahead_taken >= 30, _runner(eng).ahead_taken
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids
        # a step taken from a launched one may have run in a larger batch bucket: the
        # logits agree to float rounding, not bit for bit
        assert [lp is None for lp in a.logprobs] == [lp is None for lp in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x is None or y is None or abs(x - y) < 1e-3


def test_warm_up_leaves_greedy_tokens_unchanged(tiny_llama_dir, weights_cache_dir, monkeypatch):
    """The start-up warm-up (two prefill-shaped steps, ModelRunner._warm_up) writes KV into
    blocks no request holds yet and a device table row it gives back: the same workload
    gives the same tokens with and without it."""

    def workload(eng: LLMEngine) -> list[list[int]]:
        return _workload(eng) + [
            o.token_ids for o in eng.generate([_prompt(400, 7), _prompt(90, 8)], GREEDY)
        ]

    warm = _engine(
        tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=512, attention_backend="flex"
    )
    monkeypatch.setattr(model_runner, "WARM_UP_TOKENS", 0)  # first = 0: no warm-up
    cold = _engine(
        tiny_llama_dir, weights_cache_dir, max_num_batched_tokens=512, attention_backend="flex"
    )
    assert _runner(warm).graphs is not None
    assert workload(warm) == workload(cold)


def test_first_prefill_steps_compile_nothing_after_the_warm_up(
    tiny_llama_dir, weights_cache_dir, monkeypatch
):
    """In 16 bits the decode graphs' capture compiles only the glue of 1..64-row steps;
    prefill steps of more tokens run the general compiled glue, which the warm-up compiles
    for a first size and a symbolic one. So the first requests' steps (sizes never seen,
    with and without a cached prefix) compile no graph; without the warm-up they do."""

    def compiled_by_first_requests() -> int:
        torch._dynamo.reset()  # compiled code is per process: start from none
        eng = _engine(
            tiny_llama_dir,
            weights_cache_dir,
            max_num_batched_tokens=512,
            attention_backend="flex",
            dtype="bfloat16",
        )
        before = counters["stats"]["unique_graphs"]
        shared = _prompt(300, 3)
        eng.generate([[*shared, 5], _prompt(150, 4)], GREEDY)
        hit = eng.generate([shared + _prompt(97, 5)], GREEDY)[0]
        assert hit.num_cached_tokens == 288  # a chunk behind a cached prefix
        return counters["stats"]["unique_graphs"] - before

    assert compiled_by_first_requests() == 0
    monkeypatch.setattr(model_runner, "WARM_UP_TOKENS", 0)
    assert compiled_by_first_requests() > 0  # the check above can fail

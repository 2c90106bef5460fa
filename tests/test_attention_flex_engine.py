"""The "flex" backend inside the engine, on CPU: its compiled kernel replaced by the tile
simulator (tests/flex_simulator.py), so the plumbing around it (decode rows padded to
bucket sizes, mixed batches, prefill over a cached prefix through SDPA, device block
tables, and the decode graphs' input path with the graphs emulated) gives the same greedy
tokens as the torch reference backend."""

from __future__ import annotations

import random

import pytest
from flex_simulator import simulate_flex

from engine import cuda_graphs
from engine.attention import flex
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _outputs(eng: LLMEngine) -> list[list[int]]:
    shared = _prompt(70, 1)
    outs = [eng.generate([[*shared, 5]], GREEDY)[0].token_ids]
    hit = eng.generate([[*shared, 9, 9]], GREEDY)[0]  # 64 cached tokens, then prefill
    assert hit.num_cached_tokens == 64
    outs.append(hit.token_ids)
    prompts = [_prompt(n, 10 + n) for n in (1, 17, 40, 5, 23)]
    outs += [o.token_ids for o in eng.generate(prompts, GREEDY)]
    return outs


def test_flex_engine_with_simulated_kernel_equals_torch(
    tiny_llama_dir, weights_cache_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    def config(backend: str) -> EngineConfig:
        return EngineConfig(
            cache_dir=weights_cache_dir,
            num_blocks=48,
            max_num_batched_tokens=29,  # chunked prefills beside decodes
            attention_backend=backend,
        )

    ref = _outputs(LLMEngine.from_spec(str(tiny_llama_dir), config("torch")))
    monkeypatch.setattr(flex, "DEFAULT_KERNEL", simulate_flex)
    assert _outputs(LLMEngine.from_spec(str(tiny_llama_dir), config("flex"))) == ref


def test_graph_decode_input_path_equals_torch(
    tiny_llama_dir, weights_cache_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through DecodeGraphs' packed input buffer (ids, positions, slots, KV
    lengths and table rows in one copy, block tables gathered from DeviceBlockTables in
    place, padded buckets), the graphs emulated on CPU: tokens equal the torch engine's."""

    def config(backend: str, **kw: object) -> EngineConfig:
        return EngineConfig(
            cache_dir=weights_cache_dir,
            num_blocks=48,
            max_num_batched_tokens=29,
            max_num_seqs=6,
            attention_backend=backend,
            **kw,  # type: ignore[arg-type]
        )

    ref = _outputs(LLMEngine.from_spec(str(tiny_llama_dir), config("torch")))
    monkeypatch.setattr(flex, "DEFAULT_KERNEL", simulate_flex)
    monkeypatch.setattr(cuda_graphs, "CPU_EMULATION", True)
    eng = LLMEngine.from_spec(
        str(tiny_llama_dir), config("flex", cuda_graphs=True, compile_layers=False)
    )
    assert isinstance(eng.runner, ModelRunner) and eng.runner.graphs is not None
    assert eng.runner.graphs.sizes == [1, 2, 4, 8]
    assert _outputs(eng) == ref
    assert eng.runner.graphs.replays >= 8  # the pure-decode steps of the workload


def test_decode_ahead_equals_torch_and_is_taken(
    tiny_llama_dir, weights_cache_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps launched ahead with the previous step's tokens on the device (the
    graphs emulated on CPU): requests of different lengths finish mid-batch (the next
    step takes a subset of the launched rows), a block boundary is crossed (the next
    block is allocated a step early), seeded sampling draws the same tokens; everything
    equals the engine without it and the torch reference."""
    monkeypatch.setattr(flex, "DEFAULT_KERNEL", simulate_flex)
    monkeypatch.setattr(cuda_graphs, "CPU_EMULATION", True)

    def config(backend: str, **kw: object) -> EngineConfig:
        return EngineConfig(
            cache_dir=weights_cache_dir,
            num_blocks=48,
            max_num_seqs=4,
            attention_backend=backend,
            compile_layers=False,
            **kw,  # type: ignore[arg-type]
        )

    prompts = [_prompt(n, 30 + n) for n in (3, 14, 29, 9)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (20, 7, 12, 3)
    ]
    params[1] = SamplingParams(max_tokens=7, temperature=0.8, seed=5, ignore_eos=True)
    ref = [
        c.token_ids
        for c in LLMEngine.from_spec(str(tiny_llama_dir), config("torch")).generate(prompts, params)
    ]
    results = {}
    for ahead in (False, True):
        eng = LLMEngine.from_spec(
            str(tiny_llama_dir), config("flex", cuda_graphs=True, decode_ahead=ahead)
        )
        assert isinstance(eng.runner, ModelRunner)
        results[ahead] = [c.token_ids for c in eng.generate(prompts, params)]
        if ahead:
            # 19 decode steps after the prefill; all but a few are taken from a launch
            assert eng.runner.ahead_taken >= 12, (eng.runner.ahead_taken, eng.runner.ahead_launched)
        else:
            assert eng.runner.ahead_launched == 0
    assert results[True] == results[False] == ref


def test_decode_ahead_dropped_when_a_request_arrives(
    tiny_llama_dir, weights_cache_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request added between steps makes the next step a mixed one: the launched step
    is dropped, and the tokens still equal the torch engine's."""
    monkeypatch.setattr(flex, "DEFAULT_KERNEL", simulate_flex)
    monkeypatch.setattr(cuda_graphs, "CPU_EMULATION", True)

    def run(backend: str, **kw: object) -> tuple[dict[str, list[int]], LLMEngine]:
        eng = LLMEngine.from_spec(
            str(tiny_llama_dir),
            EngineConfig(
                cache_dir=weights_cache_dir,
                num_blocks=48,
                max_num_seqs=4,
                attention_backend=backend,
                **kw,  # type: ignore[arg-type]
            ),
        )
        long = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        outs: dict[str, list[int]] = {}
        eng.add_request(_prompt(12, 1), long, "a")
        for i in range(10):
            if i == 4:
                eng.add_request(_prompt(20, 2), long, "b")
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs, eng

    ref, _ = run("torch")
    got, eng = run("flex", cuda_graphs=True, compile_layers=False)
    assert got == ref
    assert isinstance(eng.runner, ModelRunner)
    assert eng.runner.ahead_launched > eng.runner.ahead_taken > 0

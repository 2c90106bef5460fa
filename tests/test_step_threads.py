"""Torch threads per step (engine/step_threads.py): with the unified default's policy (2
threads, 1 for pure decode) the real SmolLM2 engine runs every step that has prefill rows
on 2 threads and every decode-only step on 1, and its greedy tokens equal those of the
same engine on 2 threads throughout."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.step_threads import StepThreads
from protocol.sampling import SamplingParams

PROMPTS = [list(range(100, 160)), list(range(300, 337)), list(range(900, 1000))]


def _run(engine: LLMEngine, seen: list[tuple[int, int]]) -> list[list[int]]:
    """Greedy 8 tokens per prompt, the third prompt added mid-decode (a mixed step: the
    first two still decode there)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS[:2]):
        engine.add_request(ids, params, f"r{i}")
    outs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 4:
            engine.add_request(PROMPTS[2], params, "r2")
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    return [outs[f"r{i}"] for i in range(3)]


def test_decode_only_steps_run_on_fewer_threads(weights_cache_dir: str) -> None:
    engine = LLMEngine.from_spec(
        "builtin:smollm2-135m-instruct",
        EngineConfig(cache_dir=weights_cache_dir, attention_backend="cpu", dtype="bfloat16"),
    )
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    seen: list[tuple[int, int]] = []  # (prefill rows, torch threads) per forward
    execute = runner.execute

    def recording(scheduled, kv):  # type: ignore[no-untyped-def]
        seen.append((sum(s.num_new_tokens > 1 for s in scheduled), torch.get_num_threads()))
        return execute(scheduled, kv)

    runner.execute = recording  # type: ignore[method-assign]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = _run(engine, seen)
        assert {t for _, t in seen} == {2}
        seen.clear()
        engine.reset_prefix_cache()
        engine.step_threads = StepThreads(full=2, decode=1)
        got = _run(engine, seen)
    finally:
        torch.set_num_threads(before)
        engine.close()
    assert got == want
    assert any(p for p, _ in seen) and any(not p for p, _ in seen)
    assert all(t == (2 if p else 1) for p, t in seen), seen


def test_thread_counts_are_checked() -> None:
    with pytest.raises(ValueError):
        StepThreads(full=0, decode=1)
    assert StepThreads(full=2, decode=4).decode == 2

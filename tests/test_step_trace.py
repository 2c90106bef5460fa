"""engine/step_trace.py: an engine with a StepTrace records every step that ran (its phases
in order, each scheduled request's new tokens and whether it sampled), request milestones
round-trip, a torn last line is skipped, and without KVSERVE_STEP_TRACE nothing is made.
A tiny random Llama, float32 on CPU."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.step_trace import ENV, RequestEvent, StepRecord, StepTrace, milestones, read_trace
from protocol.sampling import SamplingParams


def test_off_unless_the_environment_names_a_directory(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(ENV, raising=False)
    assert StepTrace.from_env("unified-0") is None
    monkeypatch.setenv(ENV, str(tmp_path / "t"))
    trace = StepTrace.from_env("unified-0")
    assert trace is not None and trace.path.parent == tmp_path / "t"
    assert trace.path.name.startswith("unified-0-")
    trace.close()


def test_an_engine_records_each_step_and_its_rows(tiny_llama_dir: Path, tmp_path: Path):
    eng = LLMEngine.from_spec(
        str(tiny_llama_dir), EngineConfig(num_blocks=64, max_num_batched_tokens=16)
    )
    eng.trace = StepTrace(tmp_path / "e.jsonl")
    eng.trace.request("arrival", "a")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request(list(range(5, 45)), params, "a")  # 40 tokens: 3 chunks of <= 16
    eng.add_request(list(range(7, 12)), params, "b")
    while eng.has_unfinished():
        eng.step()
    eng.trace.request("first_token", "a")
    eng.trace.close()
    with (tmp_path / "e.jsonl").open("ab") as f:
        f.write(b'{"k": "step", "t0"')  # a torn line from a killed process
    lines = read_trace(tmp_path / "e.jsonl")
    steps = [x for x in lines if isinstance(x, StepRecord)]
    events = [x for x in lines if isinstance(x, RequestEvent)]
    assert [(e.ev, e.rid) for e in events] == [("arrival", "a"), ("first_token", "a")]
    for s in steps:
        assert s.t0 <= s.sched <= s.exec <= s.end
        assert 0 <= s.cpu0 <= s.cpu
        assert 0 < sum(r[1] for r in s.rows) <= 16
        assert s.pre == 0
    # decode rows: those whose prompt was in before the step
    assert [s.past_prompt for s in steps] == [
        sum(r[2] >= {"a": 40, "b": 5}[r[0]] for r in s.rows) for s in steps
    ]
    assert steps[-1].past_prompt >= 1 and steps[0].past_prompt == 0
    assert steps[0].queued == 2 - len(steps[0].rows)  # what the first step left waiting
    # request a: 40 prompt tokens in chunks, then 2 more decode tokens; it samples once
    # its prompt is done and at every decode step
    a = [r for s in steps for r in s.rows if r[0] == "a"]
    assert sum(r[1] for r in a) == 40 + 2
    assert [r[3] for r in a] == [r[2] + r[1] >= 40 for r in a]
    assert [r[2] for r in a] == sorted(r[2] for r in a)
    b = [r for s in steps for r in s.rows if r[0] == "b"]
    assert sum(r[1] for r in b) == 5 + 2


def test_tracing_leaves_the_tokens_alone(tiny_llama_dir: Path, tmp_path: Path):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 30))
    ref = LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(num_blocks=64))
    eng = LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(num_blocks=64))
    eng.trace = StepTrace(tmp_path / "t.jsonl")
    assert (
        eng.generate([prompt], params)[0].token_ids == ref.generate([prompt], params)[0].token_ids
    )
    assert len(read_trace(tmp_path / "t.jsonl")) == 6  # one prefill step, five decode steps


def test_an_untraced_worker_records_milestones_nowhere(tmp_path: Path):
    milestones(None)("arrival", "a")  # does nothing
    trace = StepTrace(tmp_path / "m.jsonl")
    milestones(trace)("handoff_done", "a")
    trace.close()
    [ev] = read_trace(tmp_path / "m.jsonl")
    assert isinstance(ev, RequestEvent) and (ev.ev, ev.rid) == ("handoff_done", "a")

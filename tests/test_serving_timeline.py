"""benchmarks/serving_timeline.py: exact figures of a small synthetic trace, and a real
prefill + decode cluster (tiny random Llama, CPU, Mooncake tcp handoff) traced through
its instances' `env:`, whose steps, milestones and computed tokens the timeline reads
back."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest
from cluster_harness import complete_ids, spread_prompt, start_cluster

from benchmarks.serving_timeline import cold_start, edges, load, main, origin_of, window
from engine.step_trace import ENV, RequestEvent, StepRecord

pytestmark = pytest.mark.timeout(300)


def _write(path: Path, lines: list[StepRecord | RequestEvent]) -> None:
    import msgspec

    enc = msgspec.json.Encoder()
    path.write_bytes(b"".join(enc.encode(x) + b"\n" for x in lines))


def _synthetic(tmp_path: Path) -> Path:
    """prefill-0: r1 arrives at 100.0, two steps [100.5, 101.5) (sched 0.1, exec 0.8, out
    0.1; CPU 0.5 s) and [102.0, 104.0) (CPU 2.0 s) of 300 and 100 tokens beside one
    decode row, then a 1 s step from 106.0 (a third window). decode-0 (a restarted
    instance: two files): r1 arrives at 99.9, one step [103.0, 103.5)."""
    d = tmp_path / "trace"
    d.mkdir()
    _write(
        d / "prefill-0-11.jsonl",
        [
            RequestEvent("arrival", "r1", 100.0),
            StepRecord(100.5, 100.6, 101.4, 101.5, 10.5, [("r1", 300, 0, False)], 10.0, 0, 2, 0),
            StepRecord(
                102.0,
                102.1,
                103.9,
                104.0,
                12.6,
                [("r1", 100, 300, True), ("r0", 1, 50, True)],
                10.6,
                1,
                1,
                1,
            ),
            RequestEvent("first_token", "r1", 104.2),
            StepRecord(106.0, 106.1, 106.9, 107.0, 13.0, [("r2", 8, 0, True)], 12.8, 0, 0, 0),
        ],
    )
    _write(d / "decode-0-5.jsonl", [RequestEvent("arrival", "r1", 99.9)])
    _write(
        d / "decode-0-6.jsonl",
        [StepRecord(103.0, 103.1, 103.3, 103.5, 1.2, [("r1", 1, 400, True)], 1.0, 0, 0, 1)],
    )
    return d


def test_windows_of_a_synthetic_trace(tmp_path: Path):
    traces = load(_synthetic(tmp_path))
    assert sorted(traces) == ["decode-0", "prefill-0"]
    assert len(traces["decode-0"].steps) == 1 and "arrival" in traces["decode-0"].events["r1"]
    origin = origin_of(traces)
    assert origin == 99.9
    assert edges(7.1, 5.0, 10.0, 30.0) == [0.0, 5.0, 10.0]
    assert edges(12.0, 5.0, 10.0, 30.0) == [0.0, 5.0, 10.0, 40.0]
    w = window(traces["prefill-0"], origin, 0.0, 5.0)  # [99.9, 104.9): the first two steps
    assert w.steps == 2
    assert w.busy == pytest.approx((1.0 + 2.0) / 5.0)
    assert w.step_ms == pytest.approx(1500.0)
    assert (w.sched_ms, w.exec_ms, w.out_ms) == pytest.approx((100.0, 1300.0, 100.0))
    assert w.gap_ms == pytest.approx(500.0)  # the second step's gap (the first has none)
    assert w.tok_s == pytest.approx(401 / 5.0)
    assert w.tok_step == pytest.approx(200.5)
    assert w.rows_step == 1.5 and w.dec_step == 0.5 and w.pre == 1 and w.queued == 1.5
    assert w.cpu_step == pytest.approx((0.5 + 2.0) / 3.0)
    assert w.cpu_gap == pytest.approx(0.1 / 0.5)  # 10.5 -> 10.6 over 101.5 -> 102.0
    assert (w.arrivals, w.first_tokens) == (1, 1)
    w2 = window(traces["prefill-0"], origin, 5.0, 10.0)  # the third step, 2 s after its last
    assert w2.steps == 1 and w2.busy == pytest.approx(1.0 / 5.0)
    assert w2.gap_ms == pytest.approx(2000.0) and w2.cpu_gap == pytest.approx(0.2 / 2.0)
    # a step over a window's edge: its busy time is clipped to each window
    half = window(traces["prefill-0"], origin, 0.0, 3.1)  # to 103.0: 1.0 + 1.0 of step 2
    assert half.busy == pytest.approx(2.0 / 3.1) and half.steps == 2
    cs = cold_start(traces, origin, 1)
    assert cs is not None
    assert cs.end_s == pytest.approx(104.2 - 99.9)
    assert cs.ttft_s == pytest.approx([4.3, 4.3, 4.3])  # decode's arrival -> prefill's token
    assert cs.computed_tokens == {"decode-0": 1, "prefill-0": 400}
    assert cs.instances["prefill-0"].steps == 2
    assert cold_start(traces, origin, 2) is not None  # fewer requests than asked: all of them


def test_main_prints_and_writes_the_figures(tmp_path: Path, capsys):
    d = _synthetic(tmp_path)
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text(
        json.dumps({"sent_at_s": 1.0, "ttft_s": 4.4, "error": None})
        + "\n"
        + json.dumps({"sent_at_s": 7.0, "ttft_s": None, "error": "boom"})
        + "\n"
    )
    out = tmp_path / "t.json"
    assert main([str(d), "--requests", str(reqs), "--json", str(out), "--cold", "1"]) == 0
    text = capsys.readouterr().out
    assert "cold start: the first 1 requests' first tokens by 4.3 s" in text
    got = json.loads(out.read_text())
    assert [w["steps"] for w in got["windows"]["prefill-0"]] == [2, 1]
    assert got["client"] == [
        {"sent": 1, "ttft_p50_s": 4.4, "errors": 0},
        {"sent": 1, "ttft_p50_s": None, "errors": 1},
    ]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty_dir_is_not_there")])


def test_a_traced_prefill_decode_cluster(tmp_path: Path, tiny_llama_dir: Path, weights_cache_dir):
    trace = tmp_path / "trace"
    env = {"env": {ENV: str(trace)}}
    c = start_cluster(
        tmp_path, str(tiny_llama_dir), cache_dir=weights_cache_dir, prefill=env, decode=env
    )
    lengths = [40, 70, 100]
    max_tokens = 5
    try:
        with cf.ThreadPoolExecutor(3) as ex:
            results = list(
                ex.map(
                    lambda i: complete_ids(c, spread_prompt(lengths[i], i), max_tokens), range(3)
                )
            )
    finally:
        c.stop()
    assert [r["status"] for r in results] == [200] * 3, results
    traces = load(trace)
    assert sorted(traces) == ["decode-0", "prefill-0"]
    pre, dec = traces["prefill-0"], traces["decode-0"]
    assert pre.steps and dec.steps
    assert len(pre.events) == len(dec.events) == 3
    for rid, ev in pre.events.items():
        assert ev["arrival"] <= ev["added"] <= ev["first_token"]
        assert ev["added"] <= ev["handoff_done"]
        d = dec.events[rid]  # both are sent at once; decode's landing reaches prefill
        assert d["arrival"] <= d["added"] <= ev["granted"] <= ev["handoff_done"]
        assert d["added"] <= d["prefill_token"] and d["kv_loaded"] <= d["first_token"]
        assert ev["first_token"] <= d["first_token"]
    # every prompt computed once at prefill; decode computes one token a step past it
    per_rid = {
        rid: sum(r[1] for s in pre.steps for r in s.rows if r[0] == rid) for rid in pre.events
    }
    assert sorted(per_rid.values()) == lengths
    dec_rows = [r for s in dec.steps for r in s.rows]
    assert all(r[1] == 1 for r in dec_rows) and len(dec_rows) == 3 * (max_tokens - 1)
    assert sum(s.past_prompt for s in dec.steps) == len(dec_rows)
    assert all(s.past_prompt == 0 for s in pre.steps)
    # the timeline's windows hold every step and token once
    result = main_result(trace, tmp_path)
    for name, it in traces.items():
        ws = result["windows"][name]
        assert sum(w["steps"] for w in ws) == len(it.steps)
        tokens = sum(w["tok_s"] * (w["hi"] - w["lo"]) for w in ws)
        assert tokens == pytest.approx(sum(r[1] for s in it.steps for r in s.rows))
    cold = result["cold_start"]
    assert cold["num_requests"] == 3
    assert cold["computed_tokens"]["prefill-0"] == sum(lengths)


def main_result(trace: Path, tmp_path: Path) -> dict:
    out = tmp_path / "timeline.json"
    assert main([str(trace), "--window", "1", "--json", str(out), "--cold", "3"]) == 0
    return dict(json.loads(out.read_text()))

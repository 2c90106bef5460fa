"""A failing request fails alone in the single-process engine (engine/step_isolation.py):
an injected sampling fault and an injected forward fault for one request of a batch; the
others' greedy tokens equal their solo runs, the culprit ends with an error, its KV is
freed, and the engine keeps serving. Real workers (PP stages, TP ranks, the router):
tests/test_e2e_blast_radius.py."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from engine.config import EngineConfig
from engine.faults import EngineFaults
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.step_isolation import find_culprits
from prefill_worker.handoff import HandoffScheduler
from protocol.handoff_messages import FlowOpen, FlowSend, HandoffMeta
from protocol.sampling import SamplingParams

POISON = 4242
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def solo(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):  # type: ignore[no-untyped-def]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    errors: dict[str, str] = {}
    first_step: list[RequestOutput] | None = None
    while eng.has_unfinished():
        outs = eng.step()
        first_step = outs if first_step is None else first_step
        for out in outs:
            assert isinstance(out, RequestOutput)
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                assert out.finish_reason == "error" and out.finished
                errors[out.request_id] = out.error
    return ids, tokens, errors, first_step


@pytest.mark.parametrize("place", ["sample", "forward"])
def test_one_poisoned_request_fails_alone(tiny_llama_dir, weights_cache_dir, solo, place):
    faults = EngineFaults(fail_seed=POISON, place=place)
    eng = LLMEngine.from_spec(
        str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir, faults=faults)
    )
    prompts = [_prompt(20 + 9 * i, i) for i in range(5)]
    params = [GREEDY] * 5
    params[2] = msgspec.structs.replace(GREEDY, seed=POISON)  # greedy: the seed changes nothing
    params[4] = msgspec.structs.replace(GREEDY, seed=7)
    free_before = eng.pool.num_free_blocks
    ids, tokens, errors, first_step = _run(eng, prompts, params)
    # one step prefilled all five: four sampled their first token, the culprit failed
    assert first_step is not None
    assert sorted(o.request_id for o in first_step) == sorted(ids)
    assert [o.request_id for o in first_step if o.error] == [ids[2]]
    assert list(errors) == [ids[2]]
    assert f"injected {place} fault" in errors[ids[2]]
    assert tokens[ids[2]] == []  # it never produced a token: it was in the first step
    for i in (0, 1, 3, 4):
        assert tokens[ids[i]] == solo.generate([prompts[i]], GREEDY)[0].token_ids, i
    assert eng.pool.num_free_blocks == free_before  # the culprit's KV is freed too
    # the engine keeps serving, and a later poisoned request fails alone again
    again = eng.generate([prompts[0], prompts[1]], [GREEDY, params[2]])
    assert again[0].token_ids == tokens[ids[0]]
    assert again[1].finish_reason == "error"


def test_forward_culprits_are_found_by_bisection():
    calls: list[int] = []

    def run(batch):  # type: ignore[no-untyped-def]
        calls.append(len(batch))
        bad = [x for x in batch if x in (3, 11)]
        if bad:
            raise ValueError(f"bad {bad}")

    items = list(range(16))
    try:
        run(items)
    except ValueError as e:
        found = find_culprits(items, run, e)
    assert sorted(found) == [3, 11]
    assert found[3] == "ValueError: bad [3]"
    assert len(calls) <= 1 + 2 * 2 * 4  # about 2·k·log2(n)


def test_a_failed_forward_sends_no_kv_of_its_culprit():
    handoffs = HandoffScheduler(1)
    meta = HandoffMeta(
        [FlowOpen("bad", 32, [], "u"), FlowOpen("ok", 32, [], "u")],
        [FlowSend("bad", 0, 32, [0, 1], True), FlowSend("ok", 0, 32, [2, 3], True)],
        ["gone"],
    )
    out = msgspec.msgpack.decode(
        handoffs.without_requests(msgspec.msgpack.encode(meta), {"bad"}), type=HandoffMeta
    )
    # the culprit's flow stays open (its abort cancels it, which releases its blocks)
    assert [o.request_id for o in out.opens] == ["bad", "ok"]
    assert [s.request_id for s in out.sends] == ["ok"]
    assert out.cancels == ["gone"]


def test_a_pipeline_stage_isolates_its_culprits():
    """engine/parallel/pp_isolation.py on its own: the stage's forward over a batch of 4
    sequences raises while sequence 2 is in it; forward_isolating finds it, the other
    rows hold exactly what a forward of them alone gives, the culprit's and skipped rows
    are zeros; a stage remembers culprits for `horizon` steps."""
    import torch

    from engine.parallel.pp_isolation import KnownCulprits, forward_isolating, subset_batch
    from protocol.rank_messages import StepBatch

    qsl = [0, 3, 4, 8, 10]
    batch = StepBatch(
        list(range(10)),
        [0, 1, 2, 5, 0, 1, 2, 3, 7, 8],
        qsl,
        [3, 6, 4, 9],
        [[1], [2, 3], [4], [5, 6, 7]],
    )
    sub, rows = subset_batch(batch, [1, 3])
    assert sub == StepBatch([3, 8, 9], [5, 7, 8], [0, 1, 3], [6, 9], [[2, 3], [5, 6, 7]])
    assert rows == [3, 8, 9]
    cpu = torch.device("cpu")
    hidden = torch.arange(10 * 2, dtype=torch.float32).view(10, 2)
    calls: list[list[int]] = []

    def forward(seqs, b: StepBatch, h):  # type: ignore[no-untyped-def]
        calls.append(list(seqs))
        if 2 in seqs:
            raise ValueError("bad input")
        assert h is not None and len(h) == len(b.positions)
        return h * 10 + torch.tensor(b.positions, dtype=torch.float32)[:, None]

    out, found = forward_isolating(forward, batch, hidden, set(), 2, torch.float32, cpu)
    assert found == {2: "ValueError: bad input"}
    assert calls[-1] == [0, 1, 3]
    want = hidden * 10 + torch.tensor(batch.positions, dtype=torch.float32)[:, None]
    for b in (0, 1, 3):
        assert torch.equal(out[qsl[b] : qsl[b + 1]], want[qsl[b] : qsl[b + 1]])
    assert not out[qsl[2] : qsl[3]].any()
    out, found = forward_isolating(forward, batch, hidden, {1, 2}, 2, torch.float32, cpu)
    assert found == {} and calls[-1] == [0, 3] and not out[3:8].any()
    assert torch.equal(out[8:], want[8:])

    # block size 4; "b" fails in step 5 writing positions 4, 5 of its block 3
    known = KnownCulprits(horizon=2, block_size=4)
    step5 = StepBatch([], [0, 4, 5], [0, 1, 3], [1, 6], [[9], [2, 3]])
    known.remember(5, step5, ["a", "b"], [1])
    # step 6: "b" again; "c" reads block 3 as its prefix (a hit); "d" only block 2
    step6 = StepBatch([], [6, 8, 4], [0, 1, 2, 3], [7, 9, 5], [[2, 3], [2, 3, 7], [2, 8]])
    assert known.skipped(6, step6, ["b", "c", "d"], []) == {0, 1}
    assert known.skipped(6, step6, ["b", "c", "d"], [(2, "upstream")]) == {0, 1, 2}
    # issued after the driver learnt of it (and freed and uncached its blocks)
    assert known.skipped(7, step6, ["b", "c", "d"], []) == set()

"""Penalties, logit_bias, top_logprobs and grammar masks in the engine's batched sampler.

Penalties are checked against transformers' logits processors on the same logits
(RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor) and, where transformers
has none (OpenAI's presence / frequency penalties), against OpenAI's published formula.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from engine.grammar import (
    GrammarCompiler,
    apply_bitmask,
    fill_bitmasks,
    unpack_bitmask,
    unpack_bitmask_torch,
)
from engine.logits_process import apply_penalties
from engine.sampler import Sampler, SamplingState
from modelinfo.info import load_model_info
from protocol.sampling import GrammarSpec, SamplingParams

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_repetition_penalty_equals_transformers() -> None:
    logits = _logits(3)
    prompts = [[1, 2, 3], [5, 5, 9], [0]]
    outputs = [[4, 2], [], [63, 7, 7]]
    params = [SamplingParams(repetition_penalty=p) for p in (1.3, 0.7, 2.0)]
    ours = apply_penalties(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0], rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(2, seed=1)
    bias = ((5, 7.5), (60, -100.0), (0, 0.25))
    ours = apply_penalties(
        logits, [SamplingParams(logit_bias=bias), SamplingParams()], [[], []], [[], []]
    )
    ref = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias])(
        torch.tensor([[1]]), logits[:1].clone()
    )
    torch.testing.assert_close(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = _logits(2, seed=2)
    outputs = [[3, 3, 3, 8], [10]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(presence_penalty=-2.0),
    ]
    ours = apply_penalties(logits, params, [[3, 11], [10]], outputs)
    for i, p in enumerate(params):
        ref = logits[i].clone()
        for t in set(outputs[i]):  # prompt tokens do not count (OpenAI)
            c = outputs[i].count(t)
            ref[t] -= c * p.frequency_penalty + (c > 0) * p.presence_penalty
        torch.testing.assert_close(ours[i], ref)


def test_penalties_change_greedy_choice_in_the_sampler() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 2.0
    logits[:, 4] = 1.9
    plain = SamplingState(SamplingParams(temperature=0.0), 1, output_token_ids=[9])
    penal = SamplingState(
        SamplingParams(temperature=0.0, frequency_penalty=0.2), 1, output_token_ids=[9]
    )
    out = Sampler(seed=0).sample(logits, [plain, penal])
    assert out.token_ids == [9, 4]


def test_top_logprobs_are_the_log_softmax_of_the_raw_logits() -> None:
    logits = _logits(3, seed=3)
    states = [
        SamplingState(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)),
        SamplingState(SamplingParams(temperature=0.0)),
        SamplingState(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20)),
    ]
    out = Sampler(seed=0).sample(logits, states)
    assert out.top_logprobs[1] is None and out.logprobs[1] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, k in ((0, 5), (2, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == k
        values, ids = ref[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert top[0][0] == out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(top[0][1])


def test_bitmask_masks_exactly_the_disallowed_tokens() -> None:
    logits = _logits(2, seed=4)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    bitmask[0, 1] = -(2**31)  # token 63 (the sign bit)
    bitmask[1] = -1
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed == [1, 3, 63]
    assert torch.equal(masked[1], logits[1])


def test_device_unpack_path_equals_numpy_path() -> None:
    """The accelerator path (torch shifts) and the CPU path (numpy) agree bit for bit,
    the sign bit included (checked here on the CPU: the ops are the same on a device)."""
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32)
    bitmask[0, 0] = -1
    bitmask[1, 3] = -(2**31)
    want = unpack_bitmask(bitmask, torch.device("cpu"))
    assert torch.equal(unpack_bitmask_torch(bitmask), want)
    assert want.shape == (5, 224) and want[0, :32].all() and want[1, 127] and not want[1, 96]


@pytest.fixture(scope="module")
def smollm2_compiler() -> tuple[GrammarCompiler, object]:
    info = load_model_info("builtin:smollm2-135m-instruct")
    return GrammarCompiler(info.tokenizer, info.config.vocab_size, info.eos_token_ids), info


def test_json_schema_grammar_constrains_random_sampling(smollm2_compiler) -> None:  # type: ignore[no-untyped-def]
    """Random logits, temperature 1, every draw under the mask: the text is schema-valid."""
    compiler, info = smollm2_compiler
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    spec = GrammarSpec(kind="json_schema", text=json.dumps(schema))
    vocab = info.config.vocab_size
    eos = info.eos_token_ids
    sampler = Sampler(seed=0)
    for seed in range(3):
        state = compiler.new_state(spec)
        params = SamplingParams(seed=seed, temperature=1.0)
        out: list[int] = []
        gen = torch.Generator().manual_seed(seed)
        for _ in range(200):
            logits = torch.randn(1, vocab, generator=gen)
            logits[0, eos[0]] += 2.0 * len(out) / 10  # let it finish once it may
            s = SamplingState(params, len(out), None, eos, (), out, state)
            token = sampler.sample(logits, [s]).token_ids[0]
            if token in eos:
                break
            out.append(token)
        else:
            pytest.fail(f"the grammar never allowed EOS: {info.tokenizer.decode(out)!r}")
        jsonschema.validate(json.loads(info.tokenizer.decode(out)), schema)


def test_grammar_state_rebuilds_from_output_tokens(smollm2_compiler) -> None:  # type: ignore[no-untyped-def]
    """A fresh state synced to the tokens so far gives the mask the live state gives:
    what a decode instance does after the prefill instance sampled the first token."""
    compiler, info = smollm2_compiler
    spec = GrammarSpec(kind="json_object")
    ids = info.tokenizer.encode('{"a": [1, 2', add_special_tokens=False)
    live = compiler.new_state(spec)
    for i in range(len(ids)):
        live.sync(ids[: i + 1])
    fresh = compiler.new_state(spec)
    fresh.sync(ids)
    vocab = info.config.vocab_size
    a = fill_bitmasks(1, [(0, live, info.eos_token_ids)], vocab)
    b = fill_bitmasks(1, [(0, fresh, info.eos_token_ids)], vocab)
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.full_like(a, -1))  # it constrains something


def test_bad_grammar_allows_only_eos(smollm2_compiler) -> None:  # type: ignore[no-untyped-def]
    compiler, info = smollm2_compiler
    state = compiler.new_state(GrammarSpec(kind="lark", text="start: nope("))
    state.sync([])
    assert state.error is not None
    logits = torch.zeros(1, info.config.vocab_size)
    apply_bitmask(logits, fill_bitmasks(1, [(0, state, (2,))], info.config.vocab_size))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2]


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos(smollm2_compiler) -> None:  # type: ignore[no-untyped-def]
    """A complete JSON object with min_tokens not reached: EOS is the only way on, so the
    min_tokens mask is dropped for that row rather than leaving nothing to sample."""
    compiler, info = smollm2_compiler
    eos = info.eos_token_ids
    ids = info.tokenizer.encode('{"a": 1}', add_special_tokens=False)
    vocab = info.config.vocab_size
    params = SamplingParams(temperature=0.0, min_tokens=50, max_tokens=60)
    state = SamplingState(
        params, len(ids), None, eos, (), ids, compiler.new_state(GrammarSpec(kind="json_object"))
    )
    free = SamplingState(params, len(ids), None, eos, (), ids)  # no grammar: EOS masked
    logits = torch.zeros(2, vocab)
    logits[:, eos[0]] = 5.0
    out = Sampler(seed=0).sample(logits, [state, free])
    assert out.token_ids[0] == eos[0]
    assert out.token_ids[1] != eos[0]

"""Every SamplingParams that passes validation is one the sampler can compute: a batch
mixing extreme but valid values (subnormal top_p and temperature, the bounds of every
penalty and bias, huge seeds) samples a token id in range for every row, never raises,
and a row that is alone in its batch draws the same as beside the others when seeded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, SamplingState
from protocol.sampling import MIN_REPETITION_PENALTY, SamplingParams

VOCAB = 257
EOS = 2

_tiny = st.sampled_from([5e-324, 1e-46, 1e-38, 1e-30, 1e-8])


def _unit(lo_open: bool) -> st.SearchStrategy[float]:
    base = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
    extra = _tiny | st.just(1.0)
    return (base | extra).filter(lambda x: x > 0.0) if lo_open else base | extra


params_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 64),
    temperature=st.one_of(st.floats(0.0, 2.0), _tiny, st.just(0.0), st.just(2.0)),
    top_p=_unit(lo_open=True),
    top_k=st.sampled_from([-1, 0, 1, 2, 50, VOCAB - 1, VOCAB, 10**9]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1), st.integers(-(2**63), -1)),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
    presence_penalty=st.one_of(st.floats(-2.0, 2.0), st.sampled_from([-2.0, 2.0, 5e-324])),
    frequency_penalty=st.one_of(st.floats(-2.0, 2.0), st.sampled_from([-2.0, 2.0])),
    repetition_penalty=st.one_of(
        st.floats(MIN_REPETITION_PENALTY, 2.0), st.sampled_from([MIN_REPETITION_PENALTY, 2.0])
    ),
    logit_bias=st.lists(
        st.tuples(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0, 0.0, 5e-324])),
        max_size=4,
        unique_by=lambda t: t[0],
    ).map(tuple),
)


def _valid(p: SamplingParams) -> bool:
    try:
        p.validate()
    except ValueError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(params_st.filter(_valid), min_size=1, max_size=6),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["normal", "flat", "spiky", "huge"]),
)
def test_every_valid_params_sample_in_range(
    params: list[SamplingParams], data_seed: int, shape: str
) -> None:
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(len(params), VOCAB, generator=g)
    if shape == "flat":
        logits.zero_()
    elif shape == "spiky":
        logits[:, 7] = 60.0
    elif shape == "huge":
        logits = logits * 1e4
    states = [
        SamplingState.create(p, (EOS,), num_output_tokens=i % 3) for i, p in enumerate(params)
    ]
    for i, s in enumerate(states):
        s.prompt_token_ids = [3, 7, 9, i]
        s.output_token_ids = [7, 7, 11][: s.num_output_tokens]
    out = Sampler(seed=1).sample(logits, states)
    assert len(out.token_ids) == len(params)
    for tok in out.token_ids:
        assert 0 <= tok < VOCAB
    for p, lp in zip(params, out.logprobs, strict=True):
        if p.logprobs:
            assert lp is not None and not math.isnan(lp) and lp <= 0.0


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-40])
def test_subnormal_top_p_keeps_the_top_token(top_p: float) -> None:
    """A top_p that float32 rounds to 0 samples the most likely token (the nucleus always
    holds it), at any temperature."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=t, top_p=top_p, seed=s)
        for t, s in ((1.0, 1), (2.0, None), (0.5, 3), (1.5, None))
    ]
    states = [SamplingState.create(p) for p in params]
    out = Sampler(seed=0).sample(logits, states)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_repetition_penalty_below_the_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324).validate()

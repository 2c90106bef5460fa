"""engine.sampler: greedy, temperature, top-k, top-p, seeds, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingState
from protocol.sampling import SamplingParams

VOCAB = 64
EOS = 3


def _logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * 2.0


def _state(**kw: object) -> SamplingState:
    num_output_tokens = int(kw.pop("num_output_tokens", 0))  # type: ignore[call-overload]
    return SamplingState.create(
        SamplingParams(**kw),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        num_output_tokens=num_output_tokens,
    )


def _draw_many(params: dict[str, object], logits_row: torch.Tensor, n: int = 4000) -> torch.Tensor:
    """n unseeded draws from one row's distribution (a batch of n equal rows)."""
    sampler = Sampler(seed=1234)
    states = [_state(**params) for _ in range(n)]
    out = sampler.sample(logits_row.expand(n, -1).contiguous(), states)
    return torch.tensor(out.token_ids)


def test_greedy_is_argmax_lowest_index_on_ties() -> None:
    logits = _logits(5)
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1.0  # a tie: argmax takes 7
    out = Sampler(seed=0).sample(logits, [_state(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_as_their_float32_cast(device: str, dtype: torch.dtype) -> None:
    """A decode graph returns 16-bit logits (engine/model_runner.py): rows that need only
    the argmax take it over them, every other row is sampled from their float32 cast. The
    outputs equal those of the float32 logits, ties (which 16 bits make common) included."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logits = _logits(6, seed=21, vocab=4096).to(dtype)
    logits[1, 100] = logits[1, 900] = logits[1].max() + 1  # a tie: the lowest id wins
    logits = logits.to(device)
    before = logits.clone()
    cases = [
        [_state(temperature=0.0) for _ in range(6)],  # the argmax over 16 bits
        [_state(temperature=0.0, logprobs=True, top_logprobs=3)] + [_state()] * 5,
        [_state(temperature=0.0, repetition_penalty=1.3, logit_bias=((900, -5.0),))] * 6,
        [_state(temperature=0.0, min_tokens=2)] + [_state(temperature=0.0)] * 5,
        [_state(temperature=0.9, top_k=50, top_p=0.9, seed=7)] * 3 + [_state(temperature=0.7)] * 3,
    ]
    cases[2] = [
        SamplingState(s.params, 0, None, (EOS,), prompt_token_ids=[100, 5]) for s in cases[2]
    ]
    for states in cases:
        got = Sampler(device, seed=0).sample(logits, states)
        want = Sampler(device, seed=0).sample(logits.float(), states)
        assert got == want
        assert torch.equal(logits, before)
    assert Sampler(device, seed=0).sample(logits, cases[0]).token_ids[1] == 100
    # a penalty computed in bfloat16 would tie 10 / 1.012 with 9.875 (id 5) and pick 5
    row = torch.full((1, 64), -1.0, dtype=dtype)
    row[0, 5], row[0, 10] = 9.875, 10.0
    state = SamplingState(
        SamplingParams(temperature=0.0, repetition_penalty=1.012), 0, None, (), [10]
    )
    assert Sampler(device, seed=0).sample(row.to(device), [state]).token_ids == [10]


def test_sample_does_not_modify_logits_or_state_counts() -> None:
    logits = _logits(3)
    before = logits.clone()
    states = [
        _state(temperature=0.0, min_tokens=2),
        _state(temperature=0.8, top_k=5, top_p=0.5, seed=1),
        _state(temperature=1.0),
    ]
    Sampler(seed=0).sample(logits, states)
    assert torch.equal(logits, before)
    assert [s.num_output_tokens for s in states] == [0, 0, 0]


def test_seeded_sampling_reproducible_across_runs_and_batches() -> None:
    target = _logits(1, seed=5)[0]

    def run_alone(steps: int) -> list[int]:
        state = _state(temperature=1.0, seed=42)
        tokens = []
        for _ in range(steps):
            tokens.append(Sampler(seed=0).sample(target.unsqueeze(0), [state]).token_ids[0])
            state.num_output_tokens += 1
        return tokens

    alone = run_alone(20)
    assert run_alone(20) == alone  # fresh generators, same seed: same tokens

    # Same request inside mixed batches (other seeds, unseeded, greedy rows; other
    # positions), with a differently seeded shared generator.
    state = _state(temperature=1.0, seed=42)
    in_batch = []
    for step in range(20):
        others = _logits(4, seed=100 + step)
        batch = torch.cat([others[: step % 3], target.unsqueeze(0), others[step % 3 :]])
        states = [
            _state(temperature=1.0, seed=7),
            _state(temperature=0.7),
            _state(temperature=0.0),
            _state(temperature=1.3, top_k=3),
        ]
        states.insert(step % 3, state)
        out = Sampler(seed=step).sample(batch, states)
        in_batch.append(out.token_ids[step % 3])
        state.num_output_tokens += 1
    assert in_batch == alone


def test_seeded_state_can_resume_at_a_position() -> None:
    """Decode after a handoff only needs the seed and the count of tokens so far."""
    logits = _logits(1, seed=9)
    full = _state(temperature=1.0, seed=3)
    tokens = []
    for _ in range(6):
        tokens.append(Sampler(seed=0).sample(logits, [full]).token_ids[0])
        full.num_output_tokens += 1
    resumed = _state(temperature=1.0, seed=3, num_output_tokens=4)
    assert Sampler(seed=99).sample(logits, [resumed]).token_ids[0] == tokens[4]


def test_state_built_directly_masks_and_seeds_like_create() -> None:
    """The engine builds SamplingState(params, num_output_tokens, generator, eos_ids)."""
    logits = _logits(1, seed=11)
    logits[0, EOS] = 20.0
    params = SamplingParams(temperature=1.0, seed=5, min_tokens=2)
    with_gen = SamplingState(params, 1, torch.Generator().manual_seed(123), (EOS,))
    without_gen = SamplingState(params, 1, None, (EOS,))
    assert with_gen.min_tokens_mask_ids == [EOS]
    a = Sampler(seed=0).sample(logits, [with_gen]).token_ids
    b = Sampler(seed=1).sample(logits, [without_gen]).token_ids
    assert a == b and a[0] != EOS


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: each draw is a fresh uniform pick
    sequences = set()
    for seed in range(8):
        state = _state(temperature=1.0, seed=seed)
        seq = []
        for _ in range(5):
            seq.append(Sampler(seed=0).sample(logits, [state]).token_ids[0])
            state.num_output_tokens += 1
        assert len(set(seq)) > 1  # positions draw different numbers too
        sequences.add(tuple(seq))
    assert len(sequences) == 8


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(32, seed=2)
    greedy = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=0)
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 1e-6, "seed": 5}):
        for temperature in (0.5, 1.0, 2.0):
            states = [_state(temperature=temperature, **params) for _ in range(32)]
            assert sampler.sample(logits, states).token_ids == greedy


def test_top_k_never_samples_outside_the_k_largest() -> None:
    row = _logits(1, seed=3)[0]
    draws = _draw_many({"temperature": 1.5, "top_k": 5}, row)
    allowed = set(row.topk(5).indices.tolist())
    assert set(draws.tolist()) == allowed  # nothing outside, and every allowed token drawn


def test_top_p_never_samples_outside_the_nucleus() -> None:
    row = _logits(1, seed=4)[0]
    temperature, top_p = 0.9, 0.6
    probs = (row / temperature).softmax(dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # The smallest set of top tokens whose mass reaches top_p.
    size = int((sorted_probs.cumsum(0) < top_p).sum()) + 1
    allowed = set(order[:size].tolist())
    draws = _draw_many({"temperature": temperature, "top_p": top_p}, row)
    assert set(draws.tolist()) == allowed


def test_top_p_nucleus_beyond_the_candidate_shortcut() -> None:
    """A flat row's nucleus is wider than the 1024 candidates the sampler looks at first;
    a peaked row in the same batch takes the shortcut. Both must keep exactly the nucleus."""
    vocab, n = 4096, 1000
    flat = _logits(1, seed=8, vocab=vocab)[0] * 0.01
    peaked = _logits(1, seed=9, vocab=vocab)[0] * 3.0
    top_p = 0.5
    rows = torch.stack([flat, peaked]).repeat(n, 1)  # flat, peaked, flat, peaked, ...
    states = [_state(temperature=1.0, top_p=top_p) for _ in range(2 * n)]
    draws = torch.tensor(Sampler(seed=0).sample(rows, states).token_ids)
    for row, group in ((flat, draws[0::2]), (peaked, draws[1::2])):
        sorted_probs, order = row.softmax(dim=-1).sort(descending=True)
        size = int((sorted_probs.cumsum(0) < top_p).sum()) + 1
        assert set(group.tolist()) <= set(order[:size].tolist())
    assert size < 1024  # the peaked row's nucleus fits the shortcut ...
    flat_rank = {t: r for r, t in enumerate(flat.argsort(descending=True).tolist())}
    assert max(flat_rank[t] for t in draws[0::2].tolist()) >= 1024  # ... the flat one not


def test_top_k_then_top_p_renormalizes_within_top_k() -> None:
    row = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])[0]
    # Within top-3 the probabilities are ~(0.665, 0.245, 0.090): top_p 0.8 keeps {0, 1}.
    draws = _draw_many({"temperature": 1.0, "top_k": 3, "top_p": 0.8}, row)
    assert set(draws.tolist()) == {0, 1}


def test_temperature_matches_softmax_and_sharpens() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 8000
    freq_of_top = {}
    for temperature in (0.5, 1.0, 1.5):
        draws = _draw_many({"temperature": temperature}, row, n=n)
        freq = torch.bincount(draws, minlength=len(row)).float() / n
        expected = (row / temperature).softmax(dim=-1)
        # 4.5 sigma of a binomial frequency with p <= 0.5 is < 0.026 at n = 8000.
        assert (freq - expected).abs().max() < 0.026, (temperature, freq, expected)
        freq_of_top[temperature] = float(freq[0])
    assert freq_of_top[0.5] > freq_of_top[1.0] > freq_of_top[1.5]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0  # a stop token id
    logits[0, 20] = 1.0
    sampler = Sampler(seed=0)

    def pick(**kw: object) -> int:
        return sampler.sample(logits, [_state(**kw)]).token_ids[0]

    kw = {"temperature": 0.0, "min_tokens": 2, "stop_token_ids": (9,)}
    assert pick(num_output_tokens=0, **kw) == 20
    assert pick(num_output_tokens=1, **kw) == 20
    assert pick(num_output_tokens=2, **kw) == EOS  # min_tokens reached: EOS allowed again
    # ignore_eos: EOS does not stop, so it is not masked; stop token ids still are.
    assert pick(num_output_tokens=0, ignore_eos=True, **kw) == EOS
    # Random rows are masked too.
    states = [_state(temperature=1.0, min_tokens=5, stop_token_ids=(9,)) for _ in range(500)]
    out = sampler.sample(logits.expand(500, -1).contiguous(), states)
    assert EOS not in out.token_ids and 9 not in out.token_ids


def test_logprobs_are_log_softmax_of_raw_logits_at_the_chosen_token() -> None:
    logits = _logits(5, seed=6)
    logits[3, EOS] = 50.0
    states = [
        _state(temperature=0.0, logprobs=True),
        _state(temperature=0.7, top_k=4, logprobs=True, seed=1),
        _state(temperature=1.0),
        _state(temperature=0.0, min_tokens=3, logprobs=True),  # EOS masked for sampling
        _state(temperature=1.3, top_p=0.5, logprobs=True),
    ]
    out = Sampler(seed=0).sample(logits, states)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    assert out.token_ids[3] != EOS
    for i in (0, 1, 3, 4):
        lp = out.logprobs[i]
        assert lp is not None
        assert abs(lp - float(reference[i, out.token_ids[i]])) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_with_cuda_and_cpu_generators() -> None:
    """On the GPU: greedy is argmax, filters keep their sets, and a seeded row is the same
    alone and in a batch, whether its generator lives on the GPU or (as the engine's
    Request makes it) on the CPU."""
    vocab = 49152
    logits = _logits(8, seed=12, vocab=vocab).cuda()
    greedy = [_state(temperature=0.0) for _ in range(8)]
    assert Sampler("cuda", seed=0).sample(logits, greedy).token_ids == logits.argmax(-1).tolist()

    target = logits[3:4]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=42)
    for device in ("cuda", "cpu"):
        alone, batched = [], []
        for step in range(8):
            state = SamplingState(params, step, torch.Generator(device=device), (EOS,))
            alone.append(Sampler("cuda", seed=step).sample(target, [state]).token_ids[0])
            states = [_state(temperature=0.8) for _ in range(8)]
            states[3] = SamplingState(params, step, torch.Generator(device=device), (EOS,))
            batched.append(Sampler("cuda", seed=99).sample(logits, states).token_ids[3])
        assert alone == batched, device
        assert set(alone) <= set(target[0].topk(200).indices.tolist())

    n = 2000
    row = logits[0]
    states = [_state(temperature=1.0, top_k=20) for _ in range(n)]
    draws = Sampler("cuda", seed=0).sample(row.expand(n, -1).contiguous(), states).token_ids
    assert set(draws) == set(row.topk(20).indices.tolist())

"""The sampler: one next token per row of logits, each row with its own SamplingParams.

Per row, in this order (the order vLLM and OpenAI use):

    raw logits ─▶ penalties, logit_bias ─▶ grammar mask ─▶ min_tokens mask ─▶ greedy? ─ yes ─▶ argmax
      │            (engine/logits_process.py)  (engine/grammar.py)                   │ no    (ties: lowest id)
      │                                                                              ▼
      │                                       / temperature ─▶ top-k ─▶ top-p ─▶ softmax ─▶ draw
      ▼
    logprob of the chosen token = log_softmax(raw logits)[token]; top_logprobs: the k
    largest of that row (ids and values)

Logprobs are taken from the raw logits (before penalties, masks, temperature, top-k and
top-p), as vLLM reports them by default: they are the model's own distribution.

Cost: an all-greedy batch without processing or logprobs is one argmax over [N, V] (in
the logits' own dtype: 16-bit from a decode graph, engine/model_runner.py). The
filters, penalties and masks run vectorized over the rows that use them; only the random
draw of a seeded row and the min_tokens mask are per row. Everything the host needs
(tokens, logprobs, top alternatives) comes back in one device-to-host copy per step.

Reproducibility: the random numbers of a seeded request at output position i depend only
on (seed, i), never on the batch or on earlier draws, because the request's generator is
re-seeded from (seed, i) before each draw. So the same seed and prompt give the same
tokens across runs, batch compositions, preemption with recompute, and a prefill→decode
handoff (decode only needs the seed and the number of tokens already generated).
Unseeded rows draw from the Sampler's shared generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.grammar import GrammarState, apply_bitmask, fill_bitmasks
from engine.logits_process import apply_penalties
from protocol.sampling import SamplingParams

_MIN_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy: 1/temperature would overflow float32."""

_TOP_P_CANDIDATES = (128, 1024)
"""Top-p looks for the nucleus among this many most likely tokens before it sorts a whole
row (see _nucleus_threshold)."""

_MASK64 = (1 << 64) - 1


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for (request seed, output position): splitmix64 of both, so that
    nearby seeds and positions give unrelated streams ((1, 0) and (0, 1) differ)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(slots=True)
class SamplingState:
    """Sampling state of one request: what the Sampler needs to know about its row.

    `num_output_tokens` is the number of tokens the request has generated so far; the
    engine advances it after it accepts a sampled token (the Sampler never changes it).
    A prefill→decode handoff creates the decode-side state with the count at handoff.
    `generator` (optional) is used only by seeded, non-greedy requests; the Sampler
    re-seeds it from (seed, num_output_tokens) before each draw, so its prior state never
    matters (a seeded row without one uses the Sampler's scratch generator the same way).
    Unseeded rows draw from the Sampler's shared generator.
    """

    params: SamplingParams
    num_output_tokens: int = 0
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    """Read by repetition_penalty only."""
    output_token_ids: Sequence[int] = ()
    """Tokens generated so far (len == num_output_tokens when given): penalties read
    them, and the grammar state consumes the ones it has not seen."""
    grammar: GrammarState | None = None
    """The request's grammar state when params.grammar is set (LLMEngine creates it)."""
    min_tokens_mask_ids: list[int] = field(init=False)
    """Token ids masked to -inf while num_output_tokens < params.min_tokens: the stop token
    ids, plus the EOS ids unless ignore_eos (then EOS does not stop, so it needs no mask)."""

    def __post_init__(self) -> None:
        mask_ids = list(dict.fromkeys(self.params.stop_token_ids))
        if not self.params.ignore_eos:
            mask_ids += [t for t in self.eos_token_ids if t not in mask_ids]
        self.min_tokens_mask_ids = mask_ids

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        *,
        num_output_tokens: int = 0,
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        """A state with a generator on `device` when the request is seeded and samples."""
        generator = None
        if params.seed is not None and not _is_greedy(params):
            generator = torch.Generator(device=device)
        return cls(params, num_output_tokens, generator, tuple(eos_token_ids))

    @property
    def greedy(self) -> bool:
        return _is_greedy(self.params)

    def needs_min_tokens_mask(self) -> bool:
        return self.num_output_tokens < self.params.min_tokens and bool(self.min_tokens_mask_ids)


TopLogprobs = list[tuple[int, float]]
"""(token id, logprob) of a position's most likely tokens, most likely first."""


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row; logprobs[i] is None unless row i asked for logprobs,
    top_logprobs[i] None unless it asked for top_logprobs > 0."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)


def _argmax_only(states: Sequence[SamplingState]) -> bool:
    """True when every row is greedy with no processing, mask or logprobs: the step's
    tokens are the argmax of the raw logits and nothing else reads them."""
    return all(
        s.greedy
        and not s.params.processes_logits
        and not s.params.logprobs
        and s.grammar is None
        and not s.needs_min_tokens_mask()
        for s in states
    )


class Sampler:
    """Samples one token per row of a [N, V] logits tensor: float32, or 16-bit (a decode
    graph's output, engine/model_runner.py), which `sample` casts to float32 before it
    computes on the values, unless the rows need only the argmax: over 16-bit logits it
    picks the same token as over their float32 cast (the cast is exact and keeps the
    order; ties go to the lowest id, NaN ranks highest, either way), reading half the
    bytes, with no cast.

    Owns the shared generator of unseeded rows (seeded from `seed` when given, so a whole
    engine run is reproducible) and a scratch generator for seeded rows without their own. `sample` mutates only generator states: never the logits
    it is given, never a SamplingState's fields.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.generator = torch.Generator(device=device)
        # Seeded rows whose state carries no generator of their own borrow this one; it is
        # re-seeded per row, so sharing it keeps every row's draw its own.
        self._seeded_generator = torch.Generator(device=device)
        # Unseeded rows of logits on another device (CUDA logits, a CPU-built Sampler) draw
        # from a generator on that device, seeded like `generator`: a CUDA tensor cannot
        # take a CPU generator.
        self._device_generators: dict[str, torch.Generator] = {}
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        before_wait: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        """One token per row. `before_wait(token_ids)` (the [N] int64 tokens on the device)
        runs after the copy to the host is queued and before the host waits for it: work
        queued there runs on the device while the tokens travel (engine/decode_ahead.py)."""
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        num_rows = len(states)
        if logits.dtype != torch.float32 and not _argmax_only(states):
            logits = logits.float()  # exact: every 16-bit value is a float32
        raw = logits
        logits = self._process(logits, states)

        random_rows = [i for i, s in enumerate(states) if not s.greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)  # [N]
        elif len(random_rows) == num_rows:
            token_ids = self._sample_random(logits, states)
        else:
            token_ids = logits.argmax(dim=-1)
            idx = torch.tensor(random_rows, device=logits.device)
            token_ids[idx] = self._sample_random(logits[idx], [states[i] for i in random_rows])

        # Everything the host reads goes into one float64 tensor (ids < 2^53 are exact):
        # a single device-to-host copy per step.
        pieces = [token_ids.double()]
        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs]
        top_rows = [i for i in logprob_rows if states[i].params.top_logprobs > 0]
        max_top = max((states[i].params.top_logprobs for i in top_rows), default=0)
        if logprob_rows:
            idx = torch.tensor(logprob_rows, device=logits.device)
            log_probs = torch.log_softmax(raw[idx].float(), dim=-1)  # [M, V]
            pieces.append(log_probs.gather(1, token_ids[idx].unsqueeze(1)).squeeze(1).double())
            if top_rows:
                local = torch.tensor([logprob_rows.index(i) for i in top_rows], device=idx.device)
                top = log_probs[local].topk(max_top, dim=-1)  # [R, k], descending
                pieces += [top.indices.double().flatten(), top.values.double().flatten()]
        packed = torch.cat(pieces)
        if before_wait is None:
            host = packed.tolist()
        elif packed.is_cuda:
            pinned = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            pinned.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            before_wait(token_ids)
            copied.synchronize()
            host = pinned.tolist()
        else:
            before_wait(token_ids)
            host = packed.tolist()

        tokens = [int(t) for t in host[:num_rows]]
        pos = num_rows
        logprobs: list[float | None] = [None] * num_rows
        for i in logprob_rows:
            logprobs[i] = host[pos]
            pos += 1
        top_logprobs: list[TopLogprobs | None] = [None] * num_rows
        if top_rows:
            width = len(top_rows) * max_top
            ids, values = host[pos : pos + width], host[pos + width : pos + 2 * width]
            for r, i in enumerate(top_rows):
                k = states[i].params.top_logprobs
                row = slice(r * max_top, r * max_top + k)
                top_logprobs[i] = [(int(t), v) for t, v in zip(ids[row], values[row], strict=True)]
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=top_logprobs)

    def _process(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Penalties, logit_bias, the min_tokens mask and grammar masks: a new tensor when
        any row uses one, else `logits` itself (never written)."""
        penalty_rows = [i for i, s in enumerate(states) if s.params.processes_logits]
        masked_rows = [i for i, s in enumerate(states) if s.needs_min_tokens_mask()]
        grammar_rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if not (penalty_rows or masked_rows or grammar_rows):
            return logits
        logits = logits.clone()
        if penalty_rows:
            chosen = [states[i] for i in penalty_rows]
            processed = apply_penalties(
                logits[penalty_rows] if len(penalty_rows) < len(states) else logits,
                [s.params for s in chosen],
                [s.prompt_token_ids for s in chosen],
                [s.output_token_ids for s in chosen],
            )
            if len(penalty_rows) < len(states):
                logits[torch.tensor(penalty_rows, device=logits.device)] = processed
            else:
                logits = processed
        if grammar_rows:
            rows = []
            for k, i in enumerate(grammar_rows):
                state = states[i]
                grammar = state.grammar
                assert grammar is not None
                grammar.sync(state.output_token_ids)
                rows.append((k, grammar, state.eos_token_ids))
            bitmask = fill_bitmasks(len(rows), rows, logits.shape[1])
            if len(grammar_rows) == len(states):
                apply_bitmask(logits, bitmask)
            else:  # only the constrained rows pay for the mask
                idx = torch.tensor(grammar_rows, device=logits.device)
                sub = logits[idx]
                apply_bitmask(sub, bitmask)
                logits[idx] = sub
        for i in masked_rows:
            if states[i].grammar is None:
                logits[i, states[i].min_tokens_mask_ids] = float("-inf")
                continue
            # A grammar that allows only EOS (its JSON is complete) wins over min_tokens:
            # masking EOS too would leave the row nothing to sample. Decided on the device.
            row = logits[i].clone()
            row[states[i].min_tokens_mask_ids] = float("-inf")
            logits[i] = torch.where(torch.isfinite(row).any(), row, logits[i])
        return logits

    def _sample_random(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, then one draw per row: [M, V] -> [M] int64."""
        device = logits.device
        num_rows, vocab_size = logits.shape
        temps = torch.tensor([s.params.temperature for s in states], device=device)
        x = logits / temps.unsqueeze(1)  # a new tensor: the filters below may write into it

        top_ks = [s.params.top_k if 0 < s.params.top_k < vocab_size else 0 for s in states]
        if any(top_ks):
            max_k = max(top_ks)
            k = torch.tensor(top_ks, device=device)
            top_values = x.topk(max_k, dim=-1).values  # [M, max_k], descending
            kth = top_values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))  # [M, 1]
            kth = torch.where(k.unsqueeze(1) > 0, kth, float("-inf"))
            # Ties with the k-th value are kept, so a row may keep more than k tokens.
            x.masked_fill_(x < kth, float("-inf"))

        top_p_rows = [j for j, s in enumerate(states) if s.params.top_p < 1.0]
        if top_p_rows:
            idx = torch.tensor(top_p_rows, device=device)
            p = torch.tensor([states[j].params.top_p for j in top_p_rows], device=device)
            probs = x[idx].softmax(dim=-1)  # after top-k: top-p renormalizes within it
            threshold = _nucleus_threshold(probs, p)  # [R, 1]
            x[idx] = x[idx].masked_fill(probs < threshold, float("-inf"))

        probs = x.softmax(dim=-1)
        # Exponential race: argmax(p / q) with q ~ Exp(1) draws index i with probability
        # p_i (what torch.multinomial does for one sample), and splits into per-row draws.
        # q = -log(u), u uniform in [0, 1): q > 0, and u == 0 gives q = inf, p / q = 0.
        u = torch.empty_like(probs)
        unseeded = [j for j, s in enumerate(states) if s.params.seed is None]
        shared = self._shared_generator(device) if unseeded else self.generator
        if len(unseeded) == num_rows:
            u.uniform_(generator=shared)
        elif unseeded:
            idx = torch.tensor(unseeded, device=device)
            u[idx] = torch.rand(len(unseeded), vocab_size, device=device, generator=shared)
        for j, s in enumerate(states):
            if s.params.seed is None:
                continue
            gen = s.generator if s.generator is not None else self._seeded_generator
            gen.manual_seed(_position_seed(s.params.seed, s.num_output_tokens))
            if gen.device == u.device:
                u[j].uniform_(generator=gen)
            else:  # e.g. a CPU generator for CUDA logits: draw there, then copy
                u[j] = torch.rand(vocab_size, generator=gen, device=gen.device)
        q = u.log_().neg_()
        return probs.div_(q).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device`: `generator` itself when it lives
        there, else one created on first use with the same initial seed."""
        if self.generator.device == device:
            return self.generator
        key = str(device)
        gen = self._device_generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.generator.initial_seed())
            self._device_generators[key] = gen
        return gen


def _nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest probability in each row's nucleus: [R, V], [R] -> [R, 1].

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (the
    top token always). On CPU a full sort of V is slow (~4 ms per row at V = 49K, a
    top-128 ~0.2 ms), so the nucleus is looked for among the top 128, then 1024 tokens;
    only rows whose candidates hold less than top_p of the mass sort the whole row. On
    an H200 this also beats sorting every row once the batch is large (64 rows of 49K:
    0.52 vs 0.73 ms; 256 rows: 1.06 vs 2.0 ms). Tokens tied with the threshold stay, as
    in top-k.
    """
    num_rows, vocab_size = probs.shape
    threshold = torch.empty(num_rows, 1, dtype=probs.dtype, device=probs.device)
    pending = torch.arange(num_rows, device=probs.device)
    for width in (*_TOP_P_CANDIDATES, vocab_size):
        rows = probs if pending.numel() == num_rows else probs[pending]
        p = top_p[pending]
        if width < vocab_size:
            candidates = rows.topk(width, dim=-1).values  # [r, width], descending
        else:
            candidates = rows.sort(dim=-1, descending=True).values
        threshold[pending] = _threshold_in_sorted(candidates, p)
        if width >= vocab_size:
            break
        pending = pending[candidates.sum(dim=-1) < p]
        if pending.numel() == 0:
            break
    return threshold


def _threshold_in_sorted(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, C] descending, [R] -> [R, 1]: the last token kept, i.e. the last one whose
    higher-ranked tokens hold less than top_p (the top token has 0 above it: kept)."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
    # A top_p below float32's smallest value (5e-324 is a valid float64) arrives as 0:
    # nothing has less mass above it, yet the top token is always kept.
    return sorted_probs.gather(1, num_kept.clamp_(min=1) - 1)

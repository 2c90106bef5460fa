"""RequestOutputText.extend (a read's tokens in one call, the router's path) against
append token by token: the same text, finish reason, tokens taken, stop reason and state,
for random token runs cut into random batches, with and without EOS, stop ids, min_tokens,
max_tokens and stop strings, on the real byte-level tokenizer (by table), a byte-fallback
one, and the DecodeStream path."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from modelinfo.detokenizer import RequestOutputText
from protocol.sampling import SamplingParams

SMOLLM2 = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    from modelinfo.info import load_model_info

    return load_model_info(SMOLLM2).tokenizer


def _byte_fallback() -> Tokenizer:
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁the", "s", "é", "x"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok


def _run_each(make: Any, ids: list[int], cuts: list[int]) -> tuple[Any, ...]:
    out = make()
    text, finish, taken = "", None, 0
    for token_id in ids:
        delta = out.append(token_id)
        text += delta.text
        taken += 1
        if delta.finish_reason is not None:
            finish = delta.finish_reason
            break
    return text, finish, taken, out.stop_reason, out.output_text, out.token_ids


def _run_batches(make: Any, ids: list[int], cuts: list[int]) -> tuple[Any, ...]:
    out = make()
    text, finish, taken = "", None, 0
    start = 0
    for end in [*cuts, len(ids)]:
        part, finish, n = out.extend(ids[start:end])
        text += part
        taken += n
        if finish is not None:
            assert n <= end - start
            break
        assert n == end - start
        start = end
    return text, finish, taken, out.stop_reason, out.output_text, out.token_ids


def _check(tokenizer: Any, pools: list[list[int]], eos: list[int], seed: int, trials: int) -> None:
    rng = random.Random(seed)
    stop_texts = ["the", " t", "é", "\n", "ab", "e"]
    for _ in range(trials):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 30))]
        cuts = sorted(rng.sample(range(len(ids) + 1), rng.randint(0, min(5, len(ids) + 1))))
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.choice([0, 0, 1, 3, min(max_tokens, 8)]),
            stop=tuple(rng.sample(stop_texts, rng.randint(0, 2))) if rng.random() < 0.3 else (),
            stop_token_ids=tuple(rng.sample(pools[0], 2)) if rng.random() < 0.3 else (),
            ignore_eos=rng.random() < 0.2,
        )
        skip = rng.random() < 0.7
        prompt = [rng.choice(pools[0]) for _ in range(rng.randint(0, 6))]

        def make(
            params: SamplingParams = params, prompt: list[int] = prompt, skip: bool = skip
        ) -> RequestOutputText:
            return RequestOutputText(
                tokenizer, params, eos, prompt_token_ids=prompt, skip_special_tokens=skip
            )

        each = _run_each(make, ids, cuts)
        assert _run_batches(make, ids, cuts) == each, (ids, cuts, params, skip, prompt)


def test_extend_equals_append_by_table(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = smollm2.token_bytes
    n = len(tb.table)
    broken = [i for i in range(n) if "\ufffd" in tb.table[i].decode("utf-8", "replace")]
    common = list(range(200, 2000))
    eos = list(smollm2.eos_token_ids)
    pools = [common, broken, sorted(tb.special), eos, common]
    _check(smollm2, pools, eos, seed=7, trials=3000)


def test_extend_equals_append_byte_fallback_and_decode_stream() -> None:
    tok = _byte_fallback()
    n = tok.get_vocab_size(with_added_tokens=True)
    eos = [tok.token_to_id("</s>")]
    pools = [list(range(n)), list(range(1, 257)), eos]
    _check(tok, pools, eos, seed=11, trials=1500)  # `tokenizers.Tokenizer`: DecodeStream

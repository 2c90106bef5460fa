"""modelinfo.token_bytes: streaming by an id → bytes table equals `tokenizers`' decode,
exactly: on the real model's whole vocabulary (each id alone, special tokens skipped and
not), on many random id sequences (broken UTF-8 and unfinished characters included), on a
SentencePiece byte-fallback tokenizer with and without its leading-space Strip, and
through IncrementalDetokenizer with a prompt context against the DecodeStream path."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from modelinfo.detokenizer import IncrementalDetokenizer
from modelinfo.token_bytes import ByteStream, TokenBytes, token_bytes

SMOLLM2 = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    from modelinfo.info import load_model_info

    return load_model_info(SMOLLM2).tokenizer


def _stream(tb: TokenBytes, ids: list[int], skip: bool) -> tuple[str, list[str]]:
    s = ByteStream(tb, skip_special_tokens=skip)
    parts = [s.append(i) for i in ids] + [s.flush()]
    return "".join(parts), parts


def _random_ids(rng: random.Random, pools: list[list[int]], n: int) -> list[int]:
    """n ids, each from a pool picked at random (so rare kinds, e.g. byte tokens or
    special tokens, come often)."""
    return [rng.choice(rng.choice(pools)) for _ in range(n)]


def test_the_real_vocabulary_id_by_id(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = smollm2.token_bytes
    assert tb is not None and tb.kind == "byte_level"
    assert len(tb.table) == smollm2.vocab_size
    assert tb.special == frozenset(smollm2.all_special_ids) and tb.special
    backend = smollm2.backend
    for i in range(len(tb.table)):
        for skip in (True, False):
            text, _ = _stream(tb, [i], skip)
            assert text == backend.decode([i], skip_special_tokens=skip), (i, skip)


def test_random_sequences_of_the_real_model(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = smollm2.token_bytes
    backend = smollm2.backend
    n = len(tb.table)
    # tokens that are not whole UTF-8 on their own (pieces of multi-byte characters)
    broken = [i for i in range(n) if "\ufffd" in tb.table[i].decode("utf-8", "replace")]
    assert len(broken) > 100
    outside = [n, n + 7, 10**6]  # ids outside the vocabulary: decode drops them
    pools = [list(range(n)), broken, sorted(tb.special), list(range(256)), outside]
    rng = random.Random(1234)
    for trial in range(4000):
        ids = _random_ids(rng, pools, rng.randint(1, 40))
        skip = trial % 2 == 0
        text, _ = _stream(tb, ids, skip)
        assert text == backend.decode(ids, skip_special_tokens=skip), ids


def test_a_split_emoji_shows_when_its_last_byte_comes(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = smollm2.token_bytes
    ids = smollm2.encode("ok 🦙🦙 done", add_special_tokens=False)
    _, parts = _stream(tb, ids, True)
    assert "".join(parts) == "ok 🦙🦙 done"
    assert "" in parts  # a token ending inside the emoji emitted nothing
    assert all("\ufffd" not in p for p in parts)


def _byte_fallback_tokenizer(strip: bool) -> Tokenizer:
    """A SentencePiece-style tokenizer: "<0xAB>" byte tokens, "▁" pieces, special and
    plain added tokens, the Llama 2 decoder (Strip optional)."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "▁the", "▁cat", "s", "at", "▁▁", "é", "日本", "▁語", "a▁b", "<0x4>", "x"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("▁plain▁", special=False)])
    return tok


@pytest.mark.parametrize("strip", [False, True], ids=["no-strip", "strip"])
def test_byte_fallback_random_sequences(strip: bool) -> None:
    tok = _byte_fallback_tokenizer(strip)
    tb = token_bytes(tok)
    assert tb is not None and tb.kind == "byte_fallback" and tb.strip_leading_space == strip
    n = tok.get_vocab_size(with_added_tokens=True)
    assert len(tb.byte_ids) == 256
    bytes_ = sorted(tb.byte_ids)
    utf8_lead = [i for i in bytes_ if tb.table[i][0] >= 0xC0]
    cont = [i for i in bytes_ if 0x80 <= tb.table[i][0] < 0xC0]
    pools = [list(range(n)), bytes_, utf8_lead + cont, list(range(257, n)), sorted(tb.special)]
    pools.append([n, n + 3])  # outside the vocabulary: dropped, a byte run goes on
    rng = random.Random(99)
    for trial in range(4000):
        ids = _random_ids(rng, pools, rng.randint(1, 30))
        skip = trial % 2 == 0
        text, _ = _stream(tb, ids, skip)
        assert text == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    for i in range(n):
        for skip in (True, False):
            assert _stream(tb, [i], skip)[0] == tok.decode([i], skip_special_tokens=skip), i
    # a valid run (é as two byte tokens) and an invalid one (one U+FFFD per byte token)
    e_acute = [tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    the = tok.token_to_id("▁the")
    assert _stream(tb, [*e_acute, the], True)[0] == tok.decode([*e_acute, the])
    bad = [tok.token_to_id("<0xE2>"), tok.token_to_id("<0x82>"), tok.token_to_id("<0x41>")]
    assert _stream(tb, [the, *bad, the], True)[0] == tok.decode([the, *bad, the])


def test_other_decoders_keep_decode_stream() -> None:
    tok = Tokenizer(models.BPE({"a": 0, "▁b": 1}, []))
    assert token_bytes(tok) is None  # no decoder
    tok.decoder = decoders.Metaspace()
    assert token_bytes(tok) is None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    assert token_bytes(tok) is None


def test_detokenizer_with_prompt_context_equals_the_decode_stream_path(smollm2) -> None:  # type: ignore[no-untyped-def]
    """IncrementalDetokenizer over the Tokenizer (table) against the same over its
    `tokenizers` backend (DecodeStream): the same text, primed with the same prompt."""
    tb = smollm2.token_bytes
    n = len(tb.table)
    broken = [i for i in range(n) if "\ufffd" in tb.table[i].decode("utf-8", "replace")]
    rng = random.Random(7)
    prompt = smollm2.encode("<|im_start|>user\nSay hi<|im_end|>\n", add_special_tokens=False)
    for trial in range(500):
        ids = _random_ids(rng, [list(range(n)), broken, sorted(tb.special)], rng.randint(1, 30))
        skip = trial % 3 != 0
        fast = IncrementalDetokenizer(smollm2, prompt_token_ids=prompt, skip_special_tokens=skip)
        assert fast._bytes is not None  # the table path
        ref = IncrementalDetokenizer(
            smollm2.backend, prompt_token_ids=prompt, skip_special_tokens=skip
        )
        got = "".join(fast.append(i) for i in ids) + fast.flush()
        want = "".join(ref.append(i) for i in ids) + ref.flush()
        assert got == want == smollm2.decode(ids, skip_special_tokens=skip), ids

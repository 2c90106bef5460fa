"""router/prompt_tokens.py: a templated prompt tokenized piece by piece between its
special tokens, with the pieces remembered, gives exactly the tokenizer's own ids; a
tokenizer where that identity does not hold is left to its own encode."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from modelinfo.info import load_model_info
from modelinfo.tokenizer import Tokenizer
from router.prompt_tokens import PromptEncoder


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_model_info("builtin:smollm2-135m-instruct").tokenizer


def _random_texts(rng: random.Random, specials: list[str], count: int) -> list[str]:
    """Special tokens among runs of letters, spaces, newlines, tabs, multi-byte
    characters and pieces of special tokens."""
    alphabet = [*"ab xyz\n\t  .,!?<>|_-é漢字", "🙂", "<|im", "|>", "<|", "im_start", "<|im_end"]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 8)):
            if rng.random() < 0.35:
                parts.append(rng.choice(specials))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))))
        texts.append("".join(parts))
    return texts


def test_pieces_give_the_tokenizers_ids(smollm2: Tokenizer) -> None:
    enc = PromptEncoder(smollm2)
    assert enc.by_pieces
    specials = [t.content for t in smollm2.backend.get_added_tokens_decoder().values()]
    texts = _random_texts(random.Random(7), specials, 800)
    for text in texts + texts[:300]:  # the second time from the remembered pieces
        assert enc.encode(text, add_special_tokens=False) == smollm2.encode(
            text, add_special_tokens=False
        ), text


def test_a_chat_prompt_reuses_its_template_pieces(smollm2: Tokenizer) -> None:
    enc = PromptEncoder(smollm2)
    template = (
        "<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    first = enc.encode(template.format("Hi"), add_special_tokens=False)
    cached = enc.num_cached_chars
    second = enc.encode(template.format("Bye"), add_special_tokens=False)
    # only the new user piece was added
    assert enc.num_cached_chars == cached + len("user\nBye")
    assert first == smollm2.encode(template.format("Hi"), add_special_tokens=False)
    assert second == smollm2.encode(template.format("Bye"), add_special_tokens=False)
    # a plain completions prompt is tokenized whole and not remembered
    cached = enc.num_cached_chars
    assert enc.encode("Hi there", add_special_tokens=True) == smollm2.encode("Hi there")
    assert enc.num_cached_chars == cached


@pytest.mark.parametrize("single", ["$A", "<|im_start|> $A", "<|im_start|> $A <|im_end|>"])
def test_completions_prompts_with_special_tokens(smollm2: Tokenizer, single: str) -> None:
    """add_special_tokens=True: by pieces after the post-processor's head when that is
    all it adds (nothing, or a BOS), the tokenizer's own encode otherwise; the same ids
    either way."""
    backend = Backend.from_str(smollm2.backend.to_str())
    specials = [("<|im_start|>", 1), ("<|im_end|>", 2)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[t for t in specials if t[0] in single]
    )
    tok = Tokenizer(backend, {})
    enc = PromptEncoder(tok)
    assert enc.by_pieces
    assert (enc._head is not None) == (single != "<|im_start|> $A <|im_end|>")
    names = [t.content for t in backend.get_added_tokens_decoder().values()]
    for text in _random_texts(random.Random(11), names, 200):
        assert enc.encode(text, add_special_tokens=True) == tok.encode(text), (single, text)


def test_the_remembered_pieces_stay_within_their_bound(smollm2: Tokenizer) -> None:
    enc = PromptEncoder(smollm2, max_cached_chars=400)
    rng = random.Random(3)
    for i in range(200):
        text = f"<|im_start|>user\n{i} " + "".join(rng.choice("abc ") for _ in range(30))
        assert enc.encode(text, add_special_tokens=False) == smollm2.encode(
            text, add_special_tokens=False
        )
        assert enc.num_cached_chars <= 400
    huge = "x" * 1000  # over a quarter of the bound: tokenized, not kept
    enc.encode(huge, add_special_tokens=False)
    assert enc.num_cached_chars <= 400


def test_a_tokenizer_whose_pieces_differ_keeps_its_own_encode() -> None:
    """Metaspace's prepend_scheme "first" marks only the text's first piece: a piece
    after a special token tokenizes differently alone, which the probes find."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "▁b": 5}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok = Tokenizer(backend, {})
    enc = PromptEncoder(tok)
    assert not enc.by_pieces
    for text in _random_texts(random.Random(5), ["<s>", "</s>"], 200):
        assert enc.encode(text, add_special_tokens=False) == tok.encode(
            text, add_special_tokens=False
        )


def test_stripping_added_tokens_keep_the_tokenizers_encode(smollm2: Tokenizer) -> None:
    backend = Backend.from_str(smollm2.backend.to_str())
    backend.add_special_tokens([AddedToken("<tool>", special=True, lstrip=True)])
    enc = PromptEncoder(Tokenizer(backend, {}))
    assert not enc.by_pieces


def test_plain_prompts_give_the_tokenizers_ids(smollm2: Tokenizer) -> None:
    """A plain text is tokenized whole by `encode_batch_fast` (no char offsets): the
    same ids as `encode`, with and without the special tokens added, on texts of every
    kind of character the byte-level pre-tokenizer splits on."""
    enc = PromptEncoder(smollm2)
    assert enc._fast is not None
    rng = random.Random(13)
    alphabet = [
        *"abcXYZ 019 \n\t\r.,;:!?'\"()[]{}<>/\\|_-+=*&^%$#@~`é漢字ßøñ",
        "🙂",
        "👩‍💻",
        "\u200b",
    ]
    texts = ["", " ", "  leading", "trailing  ", "Write one short sentence about caching."]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(1500)]
    for text in texts:
        for add in (True, False):
            assert enc.encode(text, add_special_tokens=add) == smollm2.encode(
                text, add_special_tokens=add
            ), text


def test_a_padding_tokenizer_keeps_its_own_encode(smollm2: Tokenizer) -> None:
    backend = Backend.from_str(smollm2.backend.to_str())
    backend.enable_padding(length=16)
    tok = Tokenizer(backend, {})
    enc = PromptEncoder(tok)
    assert enc._fast is None
    assert enc.encode("Hi there") == tok.encode("Hi there")
    assert len(enc.encode("Hi there")) == 16

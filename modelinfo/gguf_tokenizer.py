"""Rebuild a Hugging Face `tokenizers` pipeline from a GGUF file's tokenizer metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, token types and special ids
under llama.cpp's keys. This module mirrors what transformers 5 does for
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` (transformers/integrations/gguf/
gguf_tokenizer_mapping.py), so ids match it exactly, without importing transformers:

  tokenizer.ggml.model   "gpt2"  -> byte-level BPE (GPT-2 / Llama 3 / Qwen2 / SmolLM style)
                         "llama" -> SentencePiece BPE with byte fallback (Llama 2, Mistral,
                                    with Phi-3 and Gemma variants picked by architecture)
  tokenizer.ggml.pre     picks the split regex of byte-level BPE (default: GPT-2's)
  tokenizer.ggml.tokens / merges / scores / token_type
  tokenizer.ggml.{bos,eos,unknown,padding,eot,eom}_token_id, add_bos_token, add_eos_token
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from modelinfo.tokenizer import bos_eos_processor
from protocol.errors import ModelLoadError

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_SPECIAL_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# llama.cpp also ends generation on these (e.g. Llama 3's <|eot_id|>, <|eom_id|>).
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; any other value keeps GPT-2's ByteLevel regex
# (that is what transformers does, e.g. for SmolLM2's "smollm").
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            *("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"),
            *("midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"),
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def build_gguf_tokenizer(
    meta: Mapping[str, Any],
) -> tuple[tokenizers.Tokenizer, dict[str, str], tuple[int, ...]]:
    """(backend, named special tokens, extra end-of-generation ids) from GGUF metadata."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    arch = meta.get("general.architecture", "")
    if model == "gpt2":
        backend = _byte_level(meta, tokens)
    elif model == "llama":
        backend = _SENTENCEPIECE_BUILDERS.get(arch, _sentencepiece)(meta, tokens)
    else:
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level "
            "BPE) and 'llama' (SentencePiece BPE). Use the model's Hugging Face folder instead."
        )
    special_tokens = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = meta.get(key)
        if token_id is not None and 0 <= token_id < len(tokens):
            special_tokens[name] = backend.id_to_token(token_id) or tokens[token_id]
    _add_marked_tokens(backend, meta, tokens, byte_level=model == "gpt2")
    # transformers adds the named tokens as special too (they may not be marked CONTROL).
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens.values()]
    )
    # SentencePiece vocabularies add BOS unless the file says otherwise (as llama.cpp does).
    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = bos_eos_processor(
        backend,
        bos_token=special_tokens.get("bos_token") if add_bos else None,
        eos_token=special_tokens.get("eos_token") if add_eos else None,
    )
    extra_eos = tuple(meta[k] for k in _EXTRA_EOS_KEYS if meta.get(k) is not None)
    return backend, special_tokens, extra_eos


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (transformers' bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merges(
    meta: Mapping[str, Any], tokens: list[str], scores: Mapping[str, float] | None = None
) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files usually have none) ones rebuilt from the
    vocabulary: every split of a token into two tokens, best token score first."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if scores is None:
        file_scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        scores = dict(zip(tokens, file_scores, strict=False))
    found = []
    for token, score in scores.items():
        pairs = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        found.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    found.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    spelling = _byte_to_char()
    alphabet = set(spelling.values())
    # Tokens are normally stored in the byte alphabet already; respell any that are not.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(meta, tokens),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


_SP_DECODER = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]


def _sentencepiece(
    meta: Mapping[str, Any],
    tokens: list[str],
    *,
    merges: list[tuple[str, str]] | None = None,
    unk_token: str | None = None,
) -> tokenizers.Tokenizer:
    """Llama-2-style: "▁" marks spaces, one is prepended to the text, bytes fall back to
    <0xNN> tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(meta, tokens) if merges is None else merges,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
            unk_token=unk_token,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence([*_SP_DECODER, decoders.Strip(content=" ", left=1)])
    return backend


def _phi3(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """Phi-3 prepends "▁" with a normalizer, so text starting with a space keeps all of it."""
    backend = _sentencepiece(meta, tokens)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = None
    return backend


def _gemma(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """Gemma stores tokens of several spaces as real spaces, has no merges, and its merge
    order follows the token order in the file rather than the scores."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    order = {t: float(-i) for i, t in enumerate(tokens)}
    backend = _sentencepiece(meta, tokens, merges=_merges(meta, tokens, order), unk_token="<unk>")
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(_SP_DECODER)
    return backend


_SENTENCEPIECE_BUILDERS: dict[
    str, Callable[[Mapping[str, Any], list[str]], tokenizers.Tokenizer]
] = {
    "gemma": _gemma,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "phi3": _phi3,
}


def _add_marked_tokens(
    backend: tokenizers.Tokenizer, meta: Mapping[str, Any], tokens: list[str], *, byte_level: bool
) -> None:
    """Match CONTROL tokens (e.g. <|im_start|>) whole as special tokens and USER_DEFINED ones
    (e.g. <think>) whole as plain added tokens, as llama.cpp and transformers do.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a
    llama.cpp mislabel; transformers skips it, and so do we.
    """
    token_types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(_byte_to_char().values())
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and (not byte_level or set(t) <= alphabet)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    backend.add_tokens(user_defined)

"""Tokenizer: text <-> token ids, from a Hugging Face tokenizer.json or GGUF metadata."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from modelinfo.token_bytes import TokenBytes, token_bytes
from protocol.errors import ModelLoadError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The named special tokens; chat templates see them as variables of these names."""


class Tokenizer:
    """Owns one `tokenizers.Tokenizer` (the whole pipeline: normalizer, pre-tokenizer, model,
    post-processor adding BOS/EOS, decoder) and the model's named special tokens.

    Token ids are plain ints. `encode(..., add_special_tokens=True)` adds what the model's
    tokenizer adds (BOS for Llama, nothing for SmolLM2); prompts rendered by a chat template
    already carry their special tokens and are encoded with add_special_tokens=False.
    Immutable after construction; safe to share between threads.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        *,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """special_tokens: name (one of SPECIAL_TOKEN_NAMES) -> token string, only those set.
        extra_eos_token_ids: more ids that end generation besides eos_token (e.g. GGUF `eot`).
        """
        unknown = set(special_tokens) - set(SPECIAL_TOKEN_NAMES)
        assert not unknown, f"unknown special token names {unknown}"
        self._backend = backend
        self._special_tokens = {}
        for name, token in special_tokens.items():
            if backend.token_to_id(token) is not None:
                self._special_tokens[name] = token
            elif name in ("bos_token", "eos_token"):
                raise ModelLoadError(f"{name} {token!r} is not in the tokenizer's vocabulary")
            # An unk/pad token outside the vocabulary is never produced; it is dropped.
        eos = self._id_of("eos_token")
        ids = ([eos] if eos is not None else []) + list(extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(ids))
        self._all_special_ids = tuple(
            sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        )

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with special tokens from tokenizer_config.json (or the older
        special_tokens_map.json).

        As transformers 5 does, tokenizer.json's post-processor decides whether BOS/EOS are
        added; only a tokenizer.json without one takes add_bos_token/add_eos_token from
        tokenizer_config.json.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; kvserve needs the Hugging Face fast-tokenizer "
                "file (re-save the tokenizer with transformers' save_pretrained to create it)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{tokenizer_file} cannot be loaded: {e}") from None
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later file wins
            config.update(_read_json_object(folder / name))
        special_tokens = {
            name: token
            for name in SPECIAL_TOKEN_NAMES
            if (token := _token_content(config.get(name))) is not None
        }
        if backend.post_processor is None:
            backend.post_processor = bos_eos_processor(
                backend,
                bos_token=special_tokens.get("bos_token") if config.get("add_bos_token") else None,
                eos_token=special_tokens.get("eos_token") if config.get("add_eos_token") else None,
            )
        return cls(backend, special_tokens)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (reads the file's metadata)."""
        from modelinfo.gguf_config import read_gguf_header

        return cls.from_gguf_metadata(read_gguf_header(path, max_array_len=None).metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from already-read GGUF metadata
        (`modelinfo.gguf_config.read_gguf_header(path, max_array_len=None).metadata`)."""
        from modelinfo.gguf_tokenizer import build_gguf_tokenizer

        backend, special_tokens, extra_eos_ids = build_gguf_tokenizer(metadata)
        return cls(backend, special_tokens, extra_eos_token_ids=extra_eos_ids)

    # -- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are
        recognised as such; add_special_tokens adds the model's BOS/EOS around the text."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """encode() of several texts, in parallel threads inside `tokenizers`."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; skip_special_tokens drops every added token marked special."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id as the model spells it (byte-level BPE spells a
        leading space as "Ġ"), or None for an id outside the vocabulary."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self._backend.token_to_id(token)

    # -- vocabulary facts -----------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for `tokenizers.decoders.DecodeStream`);
        do not mutate it."""
        return self._backend

    @functools.cached_property
    def token_bytes(self) -> TokenBytes | None:
        """The id → bytes table of streamed detokenization (modelinfo/token_bytes.py),
        built on first use; None when the decoder is not one it reads exactly."""
        return token_bytes(self._backend)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (every id is < vocab_size)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens that are set, e.g. {"bos_token": "<s>", "eos_token": "</s>"}."""
        return dict(self._special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos_token first, then any extra ones the model declares."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Sorted ids of every added token marked special (what decode may skip)."""
        return self._all_special_ids

    def _id_of(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)


def bos_eos_processor(
    backend: tokenizers.Tokenizer, *, bos_token: str | None, eos_token: str | None
) -> processors.TemplateProcessing:
    """A post-processor that wraps each sequence in BOS/EOS (either may be None), the way
    transformers' `update_post_processor` builds it."""
    bos = f"{bos_token}:0 " if bos_token else ""
    eos = f" {eos_token}:0" if eos_token else ""
    bos_b = f" {bos_token}:1" if bos_token else ""
    eos_b = f" {eos_token}:1" if eos_token else ""
    specials = [(t, backend.token_to_id(t)) for t in (bos_token, eos_token) if t]
    return processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}",
        pair=f"{bos}$A:0{eos}{bos_b} $B:1{eos_b}",
        special_tokens=specials,
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None

"""Streamed detokenization by table: token id → the bytes it adds to the text, built once
per tokenizer, and an incremental UTF-8 decoder over them. Torch-free.

`tokenizers`' decode of a whole id sequence is, for the two decoders this handles, a
function of the concatenated bytes of its tokens, so one dict lookup per streamed token
replaces a `DecodeStream.step` (a Rust call that re-decodes a window of tokens, ~11 k
instructions a token in the router):

- "byte_level" (GPT-2 style `ByteLevel`: SmolLM2, Llama 3, Qwen): a token's string spells
  its bytes through the GPT-2 byte ↔ char map; a token with a char outside that map (an
  added token such as "<|im_start|>" spelled in plain text) adds its UTF-8. The text is
  the lossy UTF-8 decoding of all the bytes: Python's "replace" error handler and Rust's
  `from_utf8_lossy` both replace each maximal invalid subpart with one U+FFFD.
- "byte_fallback" (SentencePiece: `Replace("▁", " ")`, `ByteFallback`, `Fuse`, and
  optionally `Strip(" ", 1, 0)`): "<0xAB>" tokens are single bytes; a run of them is
  decoded as a whole when the run ends, and a run that is not valid UTF-8 becomes one
  U+FFFD per token (as ByteFallback does), never a partial decode; other tokens are their
  UTF-8 with "▁" spelled " ". Strip drops one leading space of the whole text.

Special added tokens add nothing when skipped (skip_special_tokens), ids outside the
vocabulary add nothing (the decoder drops them too). Any other decoder: `token_bytes`
gives None and the caller keeps `DecodeStream`. tests/test_token_bytes.py holds both
kinds to `tokenizers`' decode on random id sequences and on the real model's vocabulary.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import tokenizers

Kind = Literal["byte_level", "byte_fallback"]
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's map of the 256 bytes to printable chars, inverted: char → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL_CHARS = _byte_level_chars()
_NOT_A_BYTE = "\U0010ffff"  # outside latin-1: makes the encode below fail
_BYTE_LEVEL_TRANSLATE: dict[int, int | str] = {
    **{c: _NOT_A_BYTE for c in range(256)},
    **{ord(c): b for c, b in _BYTE_LEVEL_CHARS.items()},
}
"""str.translate table: a char of the byte map → the char of its byte (latin-1); any
other char below 256 → one latin-1 cannot encode (chars above 255 outside the map fail
latin-1 as they are)."""


@dataclass(frozen=True)
class TokenBytes:
    """A tokenizer's id → bytes table (what `decode` of that id adds mid-text)."""

    kind: Kind
    table: tuple[bytes, ...]
    special: frozenset[int]
    """Ids of added tokens marked special (dropped by skip_special_tokens)."""
    byte_ids: frozenset[int]
    """byte_fallback: the ids of "<0xAB>" tokens (each one byte of `table`)."""
    strip_leading_space: bool
    """byte_fallback with Strip(" ", 1, 0): the text's first char, if a space, is dropped."""
    by_id: dict[int, bytes] = field(init=False, repr=False, compare=False)
    """`table` as a dict: one `get` is the lookup, its default the answer for an id
    outside the vocabulary."""
    by_id_skipping: dict[int, bytes] = field(init=False, repr=False, compare=False)
    """The same with the special tokens' bytes empty (skip_special_tokens)."""

    def __post_init__(self) -> None:
        by_id = dict(enumerate(self.table))
        object.__setattr__(self, "by_id", by_id)
        object.__setattr__(self, "by_id_skipping", {**by_id, **dict.fromkeys(self.special, b"")})


def token_bytes(backend: tokenizers.Tokenizer) -> TokenBytes | None:
    """The table of `backend`, or None when its decoder is not one of the two kinds (or a
    normalizer-free reading of its tokens would not be exact)."""
    decoder = backend.decoder
    kind_strip = _decoder_kind(None if decoder is None else json.loads(decoder.__getstate__()))
    if kind_strip is None:
        return None
    kind, strip = kind_strip
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    byte_ids: set[int] = set()
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:
            table.append(b"")
        elif kind == "byte_level":
            try:
                table.append(token.translate(_BYTE_LEVEL_TRANSLATE).encode("latin-1"))
            except UnicodeEncodeError:  # a char outside the byte map: its UTF-8
                table.append(token.encode())
        else:
            m = _BYTE_TOKEN.match(token)
            if m is not None:
                table.append(bytes([int(m.group(1), 16)]))
                byte_ids.add(i)
            else:
                table.append(token.replace("▁", " ").encode())
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return TokenBytes(kind, tuple(table), special, frozenset(byte_ids), strip)


def _decoder_kind(decoder: object) -> tuple[Kind, bool] | None:
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "ByteLevel":
        return "byte_level", False
    if decoder.get("type") != "Sequence":
        return None
    steps = decoder.get("decoders") or []
    head = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if len(steps) < 3 or [_core(s) for s in steps[:3]] != head:
        return None
    if len(steps) == 3:
        return "byte_fallback", False
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    if len(steps) == 4 and _core(steps[3]) == strip:
        return "byte_fallback", True
    return None


def _core(step: object) -> dict[str, object]:
    return dict(step) if isinstance(step, dict) else {}


class ByteStream:
    """One request's streamed text from its token ids, through a TokenBytes table.

    `append(id)` returns the text complete now: whole UTF-8 characters only (a character
    split over byte tokens shows when its last byte comes), and with byte_fallback, a run
    of "<0xAB>" tokens only once a token that is not one ends it. `flush()` returns the
    rest at the end (an unfinished character as U+FFFD, as a full decode shows it). The
    concatenation of everything returned equals `decode(ids)` of all the ids appended."""

    def __init__(self, tb: TokenBytes, *, skip_special_tokens: bool = True) -> None:
        self._tb = tb
        self._bytes_of = tb.by_id_skipping if skip_special_tokens else tb.by_id
        self._skip = skip_special_tokens
        self._byte_level = tb.kind == "byte_level"
        self._held = b""  # byte_level: the start of a character not complete yet
        self._run = bytearray()  # byte_fallback: the pending run of byte tokens
        self._run_tokens = 0
        self._strip = tb.strip_leading_space

    def append(self, token_id: int) -> str:
        """The text `token_id` completes (maybe "")."""
        data = self._bytes_of.get(token_id, b"")
        if self._byte_level:
            # The common case is one C call: bytes that are whole UTF-8.
            if self._held:
                data = self._held + data
            try:
                text = data.decode()
            except UnicodeDecodeError:
                # Broken or unfinished: U+FFFD for each maximal invalid part, and an
                # unfinished character's bytes held for the next token.
                text, consumed = codecs.utf_8_decode(data, "replace", False)
                self._held = data[consumed:]
                return text
            self._held = b""
            return text
        if not data and self._dropped(token_id):
            return ""  # dropped before the decoder: it does not end a byte run
        if token_id in self._tb.byte_ids:
            self._run += data
            self._run_tokens += 1
            return ""
        return self._out(self._end_run() + data.decode("utf-8", "replace"))

    def extend(self, token_ids: Sequence[int]) -> str:
        """`append` of each id, the texts joined. Byte-level: the ids' bytes joined and
        decoded at once (UTF-8 decoding in pieces, holding an unfinished character, gives
        what decoding the whole does), one C call for a read's tokens."""
        if not self._byte_level:
            return "".join([self.append(token_id) for token_id in token_ids])
        get = self._bytes_of.get
        data = b"".join([get(token_id, b"") for token_id in token_ids])
        if self._held:
            data = self._held + data
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text, consumed = codecs.utf_8_decode(data, "replace", False)
            self._held = data[consumed:]
            return text
        self._held = b""
        return text

    @property
    def pending(self) -> bool:
        """True while bytes are held (an unfinished character, a byte run)."""
        return bool(self._run_tokens or self._held)

    def flush(self) -> str:
        """At the end: what is still held (an unfinished character, a byte run)."""
        if self._byte_level:
            text = self._held.decode("utf-8", "replace")
            self._held = b""
            return text
        return self._out(self._end_run())

    def _dropped(self, token_id: int) -> bool:
        """An id `decode` drops: outside the vocabulary, or a skipped special token."""
        return token_id not in self._tb.by_id or (self._skip and token_id in self._tb.special)

    def _end_run(self) -> str:
        if not self._run_tokens:
            return ""
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:
            text = _REPLACEMENT * self._run_tokens
        self._run.clear()
        self._run_tokens = 0
        return text

    def _out(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            if text[0] == " ":
                return text[1:]
        return text

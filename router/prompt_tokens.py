"""A templated prompt's token ids, its pieces between special tokens remembered.

Why: the router tokenizes every chat prompt whole, and `tokenizers` costs ~12 k
instructions a token (byte-level pre-tokenization by regex, BPE, the Encoding's offsets
and strings): ~0.5 M for a one-line chat prompt of 37 tokens, a third of the router's
work on the request. Yet most of a chat prompt was tokenized before: the template's
system prompt and role headers in every request, and in an agent's session the whole
history, which every turn sends again.

    <|im_start|>system\nYou are ...<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    └─ special ─┘└──── piece (kept) ───┘└special┘   ...       └ piece ┘             └ piece (kept) ┘

`tokenizers` itself first splits a text at its added tokens that are matched before
normalization (the special ones, as a rule; leftmost-longest), then normalizes and
tokenizes each piece between them on its own (added tokens matched after normalization,
pre-tokenizer, model), so the ids of the whole are the pieces' ids with those tokens'
ids between them. `PromptEncoder` splits the same way and looks each piece up in an LRU
of pieces seen before (bounded by their total characters); a piece not seen is
tokenized alone. It serves only tokenizers where that identity holds: those added
tokens without lstrip / rstrip / single_word, no truncation or padding; and, checked
at construction, probe texts (spaces and newlines on either side of special tokens,
pieces that are only whitespace, adjacent special tokens) tokenize the same both ways.
Anything else takes the tokenizer's own encode.

Every text, whole or piece, is tokenized by `tokenizers`' `encode_batch_fast` of that
one text: the same ids as `encode` without the character offsets (a byte -> char hash
map per pre-token; an 8-token prompt's call counted ~97 k instructions instead of
~115 k), which no caller reads. One text is not split, so it runs in the calling thread
(rayon's pool is started, idle). Only where truncation and padding are off, and checked
on the probe texts at construction.

A completions prompt is tokenized by pieces only when it holds a special token (the
client templated it) and add_special_tokens=True adds only a head (BOS, or nothing:
probed); a plain completions prompt is one piece, and remembering it would serve only
the same prompt sent again verbatim, so it is tokenized whole as before.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from modelinfo.tokenizer import Tokenizer

_PROBE_TEXTS = (
    "",
    "hello",
    " hello world ",
    "\n\n",
    "a\n",
    "{s}",
    "{s}{s}",
    "{s}user\nHi there{e}\n{s}assistant\n",
    " {s} x {e} ",
    "x{s}\n\n {e}\n y",
    "{s}system\n  indented\ttext{e}{s}",
    "é🙂 {s}çà{e}ü",
    "{e}\n{s}",
)
"""Texts tokenized both ways when a PromptEncoder is built ({s}, {e}: special tokens)."""


class PromptEncoder:
    """Owns the LRU of pieces' token ids for one tokenizer; thread-safe (large prompts
    are tokenized in a worker thread)."""

    def __init__(self, tokenizer: Tokenizer, max_cached_chars: int = 8 * 1024 * 1024) -> None:
        self._tokenizer = tokenizer
        self._max_chars = max_cached_chars
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        """Piece -> its ids, 4 bytes an id (a list would hold an int object per id)."""
        self._num_chars = 0
        self._lock = threading.Lock()
        self._special: dict[str, int] = {}
        self._splitter: re.Pattern[str] | None = None
        self._fast: Any = None
        """`backend.encode_batch_fast`, or None: the tokenizer's own encode."""
        self._head: list[int] | None = None
        """What add_special_tokens=True puts before a text (BOS, or nothing), when that
        is all it adds (probed); None: such texts take the tokenizer's own encode."""
        self.by_pieces = self._setup(tokenizer.backend)
        """False: every text takes the tokenizer's own encode (the identity above was
        not shown for this tokenizer)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids `tokenizer.encode` gives for `text`. With add_special_tokens (a
        completions prompt), by pieces only a text that holds a special token (one the
        client templated itself): a plain text is one piece, which would be
        remembered only for being sent again verbatim."""
        splitter = self._splitter
        if splitter is None or (
            add_special_tokens and (self._head is None or splitter.search(text) is None)
        ):
            return self._encode(text, add_special_tokens)
        head = self._head
        ids: list[int] = list(head) if add_special_tokens and head is not None else []
        special = self._special
        start = 0
        for match in splitter.finditer(text):
            if match.start() > start:
                ids += self._piece(text[start : match.start()])
            ids.append(special[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    @property
    def num_cached_chars(self) -> int:
        return self._num_chars

    def _piece(self, piece: str) -> array[int] | list[int]:
        with self._lock:
            kept = self._pieces.get(piece)
            if kept is not None:
                self._pieces.move_to_end(piece)
                return kept
        ids = self._encode(piece, False)
        if len(piece) <= self._max_chars // 4:  # one huge piece does not flush the rest
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = array("i", ids)
                    self._num_chars += len(piece)
                    while self._num_chars > self._max_chars:
                        old, _ = self._pieces.popitem(last=False)
                        self._num_chars -= len(old)
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The tokenizer's ids of `text` (see the module's note on `encode_batch_fast`)."""
        if self._fast is None:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = self._fast([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def _setup_fast(self, backend: Any) -> None:
        """Use `encode_batch_fast` when it gives `encode`'s ids on every probe text."""
        if backend.truncation is not None or backend.padding is not None:
            return
        fast = backend.encode_batch_fast
        specials = list(backend.get_added_tokens_decoder().values())
        s, e = (specials[0].content, specials[-1].content) if specials else ("", "")
        for probe in _PROBE_TEXTS:
            text = probe.format(s=s, e=e)
            for add in (False, True):
                if fast([text], add_special_tokens=add)[0].ids != self._tokenizer.encode(
                    text, add_special_tokens=add
                ):
                    return
        self._fast = fast

    def _setup(self, backend: Any) -> bool:
        self._setup_fast(backend)
        if backend.truncation is not None or backend.padding is not None:
            return False
        special: dict[str, int] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.normalized:
                continue  # matched inside the normalized pieces: the same in a piece alone
            if token.lstrip or token.rstrip or token.single_word:
                return False
            special[token.content] = token_id
        if not special:
            return False
        # Leftmost, and the longest of the tokens that start there (tokenizers' rule).
        alternatives = sorted(special, key=len, reverse=True)
        self._special = special
        self._splitter = re.compile("|".join(map(re.escape, alternatives)))
        tokens = sorted(special)
        first, last = tokens[0], tokens[-1]
        for probe in _PROBE_TEXTS:
            text = probe.format(s=first, e=last)
            if self.encode(text, add_special_tokens=False) != self._tokenizer.encode(
                text, add_special_tokens=False
            ):
                self._splitter = None
                self._pieces.clear()
                self._num_chars = 0
                return False
        head = self._tokenizer.encode("", add_special_tokens=True)
        self._head = head
        for probe in _PROBE_TEXTS:
            text = probe.format(s=first, e=last)
            if head + self._tokenizer.encode(
                text, add_special_tokens=False
            ) != self._tokenizer.encode(text, add_special_tokens=True):
                self._head = None
                break
        return True

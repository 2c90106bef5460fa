"""Generated token ids → streamed text, with OpenAI stop semantics. Torch-free.

Three pieces, each usable alone:

- `IncrementalDetokenizer(tokenizer)`: `append(token_id) -> str` returns the text that
  is safe to emit now; `flush() -> str` returns what is still held at the end. It never
  emits half a UTF-8 character: a token that ends inside a multi-byte character (an emoji
  split over byte tokens) yields "" until the character completes. A tokenizer whose
  decoder modelinfo/token_bytes.py reads exactly streams by table (one lookup and an
  incremental UTF-8 decode a token); others decode a small window of recent tokens
  (tokenizers' DecodeStream, or vLLM's prefix/read offsets here), so a token costs O(1).
- `StopChecker(params, eos_token_ids)`: the token-level stop rules, for the engine
  (which has no text): `check(token_id, num_output_tokens) -> "stop" | "length" | None`.
- `RequestOutputText(tokenizer, params, eos_token_ids)`: both of the above plus stop
  strings, one per request: `append(token_id) -> TextDelta(text, finish_reason)`, and
  `finish(reason) -> TextDelta` when the request ends for a reason decided elsewhere
  (the engine's context limit). Concatenating every `TextDelta.text` gives the final
  text (`output_text`); `stop_reason` says which EOS/stop id or stop string ended it.

Stop rules (OpenAI / vLLM):
- "stop": an EOS id (unless ignore_eos), a stop_token_id, or a stop string in the text;
  none of these counts before the request has `min_tokens` outputs (the token being
  checked included; the sampler already masks EOS and stop ids for the first min_tokens
  tokens, so only stop strings can end the text at exactly min_tokens).
- "length": max_tokens outputs. A stop on the last allowed token reports "stop".
- EOS and stop token ids are never part of the text. A stop string and everything after
  it are cut; text that could be the start of a stop string is held back until the next
  tokens show whether it is one, and flushed at finish:

      text so far:   "Hello wor" + "ld###"     stop = ("###END",)
      emitted:       "Hello world"             held back: "###" (a prefix of "###END")
      next "END":    match at 11 → finish "stop", nothing more emitted; text "Hello world"
      next "!!":     "###!!" is no stop prefix → emit "###!!"

A stop string that lies wholly inside text already emitted (possible only when
min_tokens delayed the check) no longer counts: emitted text is never taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

from modelinfo.token_bytes import ByteStream, TokenBytes
from protocol.sampling import SamplingParams

FinishReason = Literal["stop", "length"]

_PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the first output token, so tokenizers that drop a leading
space at the start of a decode (SentencePiece) keep the first output token's space."""

_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (modelinfo.tokenizer.Tokenizer and
    tokenizers.Tokenizer both fit)."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens, fed one at a time, into text deltas.

    Window over `_tokens` (the prompt context, then every output token):

        [ ..... | prefix_offset ...... read_offset ...... end ]
                  └ decoded before ──┘ └ new, not yet emitted ┘

    Each append decodes tokens[prefix_offset:read_offset] and tokens[prefix_offset:]; the
    difference is the new text. It is emitted only when it does not end in U+FFFD (an
    incomplete UTF-8 sequence); then the window slides to [read_offset, end].
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        *,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._bytes = _byte_stream(tokenizer, self._tokens, skip_special_tokens)
        self._stream: Any = None
        self._backend: Any = None
        if self._bytes is None:
            self._stream, self._backend = _decode_stream(
                tokenizer, self._tokens, skip_special_tokens
            )

    def append(self, token_id: int) -> str:
        """Adds one output token; returns the text that is complete now (maybe "")."""
        if self._bytes is not None:
            return self._bytes.append(token_id)
        self._tokens.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # a decode the stream cannot follow: the window from now on
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
                return str(text)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def extend(self, token_ids: Sequence[int]) -> str:
        """`append` of each output token, the texts joined (by table: one decode)."""
        if self._bytes is not None:
            return self._bytes.extend(token_ids)
        return "".join([self.append(token_id) for token_id in token_ids])

    def flush(self) -> str:
        """At finish: the text still held back (an unfinished character shows as U+FFFD,
        as a full decode of the output would show it)."""
        if self._bytes is not None:
            return self._bytes.flush()
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        window = self._tokens[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        skip = self._skip_special_tokens
        prefix_text = self._tokenizer.decode(window[:read], skip_special_tokens=skip)
        new_text = self._tokenizer.decode(window, skip_special_tokens=skip)
        return prefix_text, new_text


def _byte_stream(
    tokenizer: TokenDecoder, context: list[int], skip_special_tokens: bool
) -> ByteStream | None:
    """A ByteStream over `tokenizer`'s id → bytes table, primed with `context` (its text
    is the prompt's, not emitted), or None: no table (another decoder), or a context that
    ends inside a character or a byte run (what it holds is the prompt's)."""
    table = getattr(tokenizer, "token_bytes", None)
    if not isinstance(table, TokenBytes):
        return None
    stream = ByteStream(table, skip_special_tokens=skip_special_tokens)
    stream.extend(context)  # one call: `extend` is `append` of each id
    return None if stream.pending else stream


def _decode_stream(
    tokenizer: TokenDecoder, context: list[int], skip_special_tokens: bool
) -> tuple[Any, Any]:
    """tokenizers' DecodeStream over `tokenizer`'s backend, primed with `context`, or
    (None, None) to decode windows here. The stream runs the same window rule (emit when
    the text grew and does not end in U+FFFD, then slide) in Rust, at about 60% of the
    cost of two decode() calls per token from Python. A context that ends inside a
    character would leave the stream's window on the prompt: windows here then."""
    backend = getattr(tokenizer, "backend", tokenizer)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None, None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    if context and stream.step(backend, context) is None:
        return None, None
    return stream, backend


class StopChecker:
    """Token-level stop rules of one request's SamplingParams (no text needed).

    `stop_reason` tells what stopped it: the EOS or stop token id, or (set by
    RequestOutputText) the stop string; None for "length".
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.stop_reason: int | str | None = None

    def is_stop_token(self, token_id: int, num_output_tokens: int) -> bool:
        """True when `token_id`, the request's `num_output_tokens`-th output, ends it as
        "stop" (EOS not ignored, or a stop token id, once min_tokens outputs exist)."""
        return token_id in self._stop_ids and num_output_tokens >= self.params.min_tokens

    def check(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        """Finish reason after the request's `num_output_tokens`-th output `token_id`."""
        if self.is_stop_token(token_id, num_output_tokens):
            self.stop_reason = token_id
            return "stop"
        if num_output_tokens >= self.params.max_tokens:
            return "length"
        return None


class TextDelta(NamedTuple):
    """Text to emit now, and the finish reason once the request is done."""

    text: str
    finish_reason: FinishReason | None


class RequestOutputText:
    """One request's output: tokens in, emit-safe text deltas and the finish reason out.

    Owns the detokenizer, the stop checker and the output text. After a finish reason was
    returned, `append` must not be called again. If the finish is "stop" by a stop string,
    the engine must still be told to stop generating (the engine only sees token rules).
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        *,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.params = params
        self.stop_checker = StopChecker(params, eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids=prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self.token_ids: list[int] = []
        """Every output token, the final EOS or stop token id included."""
        self.output_text = ""
        """The text so far (emitted plus held back); the final text once finished."""
        self.finish_reason: FinishReason | None = None
        self._num_emitted_chars = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stop_reason(self) -> int | str | None:
        return self.stop_checker.stop_reason

    def append(self, token_id: int) -> TextDelta:
        """Adds the next output token; returns the text safe to emit and, on the last
        token, the finish reason. Raises RuntimeError once the request has finished."""
        if self.finish_reason is not None:
            raise RuntimeError("RequestOutputText.append called after the request finished")
        self.token_ids.append(token_id)
        count = len(self.token_ids)
        if self.stop_checker.is_stop_token(token_id, count):
            self.stop_checker.stop_reason = token_id
            return self.finish("stop")
        self.output_text += self.detokenizer.append(token_id)
        if count >= self.params.max_tokens:
            return self.finish("length")
        if self._cut_at_stop_string():
            return self._finish("stop")
        held = _held_back_len(self.output_text, self.params.stop, self._num_emitted_chars)
        return TextDelta(self._take_text(len(self.output_text) - held), None)

    def extend(self, token_ids: Sequence[int]) -> tuple[str, FinishReason | None, int]:
        """`append` of each token in turn until one finishes the request: the deltas'
        texts joined, the finish reason (None if none finished it) and how many tokens
        were taken (those after a finish are not). Without stop strings nothing is held
        back, so a run of tokens is checked against the token rules and detokenized as
        one (IncrementalDetokenizer.extend); with stop strings, token by token."""
        if self.params.stop or self.finish_reason is not None:
            return self._extend_each(token_ids)
        num_before = len(self.token_ids)
        take = len(token_ids)
        finish: FinishReason | None = None
        room = max(1, self.params.max_tokens - num_before)  # a token is always taken
        if room <= take:
            take, finish = room, "length"
        stop_ids = self.stop_checker._stop_ids
        if not stop_ids.isdisjoint(token_ids[:take]):  # one C call when none is there
            min_tokens = self.params.min_tokens
            for i in range(take):  # a stop id wins over "length" on the same token
                token_id = token_ids[i]
                if token_id in stop_ids and num_before + i + 1 >= min_tokens:
                    take, finish = i + 1, "stop"
                    self.stop_checker.stop_reason = token_id
                    break
        taken = token_ids[:take] if take < len(token_ids) else token_ids
        self.token_ids.extend(taken)
        # the stop id itself is never text
        text = self.detokenizer.extend(taken[:-1] if finish == "stop" else taken)
        self.output_text += text
        self._num_emitted_chars = len(self.output_text)
        if finish is not None:
            text += self.finish(finish).text
        return text, finish, take

    def _extend_each(self, token_ids: Sequence[int]) -> tuple[str, FinishReason | None, int]:
        parts: list[str] = []
        for taken, token_id in enumerate(token_ids, 1):
            delta = self.append(token_id)
            parts.append(delta.text)
            if delta.finish_reason is not None:
                return "".join(parts), delta.finish_reason, taken
        return "".join(parts), None, len(token_ids)

    def finish(self, reason: FinishReason) -> TextDelta:
        """Ends the request and returns the rest of its text: what the detokenizer and the
        stop-string hold-back kept. Use it when the request ends for a reason decided
        elsewhere (the engine's context limit: "length"); append calls it itself. A stop
        string completed by the flushed text still cuts it and makes the reason "stop"."""
        if self.finish_reason is not None:
            raise RuntimeError("RequestOutputText.finish called after the request finished")
        self.output_text += self.detokenizer.flush()
        if self._cut_at_stop_string():
            reason = "stop"
        return self._finish(reason)

    def _cut_at_stop_string(self) -> bool:
        """Cuts output_text before the first stop string not yet emitted; True if found."""
        if not self.params.stop or len(self.token_ids) < self.params.min_tokens:
            return False
        match = _find_stop(self.output_text, self.params.stop, self._num_emitted_chars)
        if match is None:
            return False
        start, stop = match
        self.output_text = self.output_text[:start]
        self.stop_checker.stop_reason = stop
        return True

    def _finish(self, reason: FinishReason) -> TextDelta:
        self.finish_reason = reason
        return TextDelta(self._take_text(len(self.output_text)), reason)

    def _take_text(self, end: int) -> str:
        text = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return text


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string occurrence beginning at or after `start`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def _held_back_len(text: str, stops: Sequence[str], start: int) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a stop
    string: it may still become a stop string, so it is not emitted yet."""
    pending = len(text) - start
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, pending), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held

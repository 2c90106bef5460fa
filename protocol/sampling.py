"""Sampling parameters: sent from the router to the workers, consumed by the engine's sampler."""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_TOP_LOGPROBS = 20
MAX_STOP_CHARS = 1024
"""Longest stop sequence: every generated token is checked against each, and the text
that may start one is held back from the stream."""
"""Most alternatives per token a request may ask for (OpenAI's limit)."""


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the generated text, compiled by the engine's grammar engine.

    kind "json_object": any JSON object (`text` unused); "json_schema": `text` is a JSON
    schema (strict: no keys outside it); "lark": `text` is a Lark grammar in llguidance's
    dialect (it may embed schemas with `%json {...}`; tool calls use it).
    """

    kind: Literal["json_object", "json_schema", "lark"]
    text: str = ""

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.text)


MIN_REPETITION_PENALTY = 1e-4
"""Smallest repetition_penalty: a logit divided by less could overflow float32."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What to generate and when to stop, with OpenAI semantics.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    `stop` strings end generation and are not part of the returned text.
    `max_tokens` counts generated tokens; `min_tokens` suppresses EOS and stop strings and
    stop token ids until that many tokens exist.

    Logit processing, in order, before temperature: `repetition_penalty` (transformers'
    rule over prompt + output tokens: a positive logit is divided by it, a negative one
    multiplied), `frequency_penalty` x count and `presence_penalty` x (count > 0) over
    output tokens (OpenAI's rule, subtracted), `logit_bias` (token id, bias) added, then
    the `grammar`'s mask. `top_logprobs` alternatives per token come with `logprobs`.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad field; the boundary turns it into a 400."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in self.stop):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters long")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2], got "
                f"{self.repetition_penalty}"
            )
        if len(self.logit_bias) > 300:
            raise ValueError("logit_bias may hold at most 300 tokens")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty or bias changes this request's logits before sampling."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

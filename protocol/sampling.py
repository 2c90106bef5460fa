"""Sampling parameters: sent from the router to the workers, consumed by the engine's sampler."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What to generate and when to stop, with OpenAI semantics.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    `stop` strings end generation and are not part of the returned text.
    `max_tokens` counts generated tokens; `min_tokens` suppresses EOS and stop strings and
    stop token ids until that many tokens exist.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

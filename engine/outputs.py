"""What the engine gives back: RequestOutput per request per step, Completion per finished
request of `LLMEngine.generate`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import TopLogprobs
from protocol.ids import RequestId


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: RequestId
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    text_delta: str
    finish_reason: str | None
    """None while running; "stop", "length" or "abort" when finished."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from this engine's prefix cache."""
    num_output_tokens: int
    num_pool_tokens: int = 0
    """Prompt tokens loaded through the KV connector (the pool); gpu + pool + computed =
    prompt, so computed = num_prompt_tokens - num_cached_tokens - num_pool_tokens."""
    prefill_done: bool = False
    """A prefill-only request sampled its first token and left the engine (its KV was
    handed on through the KV connector); finish_reason stays None: decode continues it."""
    new_top_logprobs: list[TopLogprobs | None] | None = None
    """Per new token, its top_logprobs alternatives when the request asked for them."""
    error: str | None = None
    """Set (finish_reason "error", no new tokens) when this request alone made its step
    fail (engine/step_isolation.py): it left the engine, its KV freed; the others of
    the step went on."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.prefill_done


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: RequestId
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float | None]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_pool_tokens: int = 0

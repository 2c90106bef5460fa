"""OpenAI response bodies: streamed chunks (SSE) and whole responses, chat and completion.

Chat stream:        {"object": "chat.completion.chunk", "choices": [{"index": 0,
                     "delta": {"role"?, "content"}, "logprobs", "finish_reason"}], ...}
Completion stream:  {"object": "text_completion", "choices": [{"index": 0, "text",
                     "logprobs", "finish_reason"}], ...}
With stream_options.include_usage every chunk has "usage": null and one last chunk has
"choices": [] and the usage. Usage carries prompt_tokens_details with the prefill's
split: cached_tokens (= gpu + pool), gpu_tokens, pool_tokens, computed_tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from modelinfo.tokenizer import Tokenizer
from protocol.messages import PromptUsage
from router.output import OutputDelta
from router.preprocess import PreparedRequest

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + _encode(obj) + b"\n\n"


def usage_dict(num_prompt: int, num_completion: int, usage: PromptUsage | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }
    if usage is not None:
        out["prompt_tokens_details"] = {
            "cached_tokens": usage.gpu_tokens + usage.pool_tokens,
            "gpu_tokens": usage.gpu_tokens,
            "pool_tokens": usage.pool_tokens,
            "computed_tokens": usage.computed_tokens,
        }
    return out


class ResponseFormatter:
    """Builds one request's response bodies. Holds back logprobs of tokens whose text is
    not out yet, so each chunk's logprobs match its text."""

    object_chunk = ""
    object_full = ""

    def __init__(self, req: PreparedRequest, tokenizer: Tokenizer) -> None:
        self.req = req
        self._tokenizer = tokenizer
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[float | None] = []
        self._text_offset = 0

    # -- streaming ------------------------------------------------------------------------

    def stream_start(self) -> bytes:
        """Bytes sent before the first delta (chat: the role chunk)."""
        return b""

    def stream_delta(self, delta: OutputDelta) -> bytes:
        """The SSE chunk for `delta`, or b"" when there is nothing to say yet."""
        if self.req.logprobs:
            self._pending_ids += delta.token_ids
            self._pending_logprobs += delta.logprobs
        if not delta.text and delta.finish_reason is None:
            return b""
        logprobs = self._take_logprobs() if self.req.logprobs else None
        choice = self._choice_delta(delta.text, logprobs, delta.finish_reason)
        return sse(self._envelope(self.object_chunk, [choice], stream=True))

    def stream_usage(self, num_completion: int, usage: PromptUsage | None) -> bytes:
        body = self._envelope(self.object_chunk, [], stream=True)
        body["usage"] = usage_dict(len(self.req.prompt_token_ids), num_completion, usage)
        return sse(body)

    # -- whole response -----------------------------------------------------------------------

    def add_logprobs(self, delta: OutputDelta) -> None:
        """Non-streaming: collect logprobs as deltas arrive."""
        if self.req.logprobs:
            self._pending_ids += delta.token_ids
            self._pending_logprobs += delta.logprobs

    def response(
        self, text: str, finish_reason: str | None, num_completion: int, usage: PromptUsage | None
    ) -> bytes:
        logprobs = self._take_logprobs() if self.req.logprobs else None
        body = self._envelope(self.object_full, [self._choice_full(text, logprobs, finish_reason)])
        body["usage"] = usage_dict(len(self.req.prompt_token_ids), num_completion, usage)
        return _encode(body)

    # -- pieces -------------------------------------------------------------------------------

    def _envelope(self, obj: str, choices: list[Any], stream: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.req.request_id,
            "object": obj,
            "created": self.req.created,
            "model": self.req.model,
            "choices": choices,
        }
        if stream and self.req.include_usage:
            body["usage"] = None
        return body

    def _take_logprobs(self) -> Any:
        ids, lps = self._pending_ids, self._pending_logprobs
        self._pending_ids, self._pending_logprobs = [], []
        tokens = [self._tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return self._format_logprobs(tokens, lps)

    def _format_logprobs(self, tokens: list[str], logprobs: list[float | None]) -> Any:
        raise NotImplementedError

    def _choice_delta(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormatter(ResponseFormatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def stream_start(self) -> bytes:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse(self._envelope(self.object_chunk, [choice], stream=True))

    def _format_logprobs(self, tokens: list[str], logprobs: list[float | None]) -> Any:
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=False)
        ]
        return {"content": content, "refusal": None}

    def _choice_delta(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}


class CompletionFormatter(ResponseFormatter):
    object_chunk = "text_completion"
    object_full = "text_completion"

    def _format_logprobs(self, tokens: list[str], logprobs: list[float | None]) -> Any:
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        top = (
            [{t: lp} for t, lp in zip(tokens, logprobs, strict=False)]
            if self.req.top_logprobs
            else None
        )
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _choice_delta(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


def formatter_for(req: PreparedRequest, tokenizer: Tokenizer) -> ResponseFormatter:
    return (
        ChatFormatter(req, tokenizer) if req.kind == "chat" else CompletionFormatter(req, tokenizer)
    )

"""OpenAI response bodies: streamed chunks (SSE) and whole responses, chat and completion.

Chat stream:        {"object": "chat.completion.chunk", "choices": [{"index": 0,
                     "delta": {"role"?, "content"}, "logprobs", "finish_reason"}], ...}
Completion stream:  {"object": "text_completion", "choices": [{"index": 0, "text",
                     "logprobs", "finish_reason"}], ...}
With stream_options.include_usage every chunk has "usage": null and one last chunk has
"choices": [] and the usage. Usage carries prompt_tokens_details with the prefill's
split: cached_tokens (= gpu + pool), gpu_tokens, pool_tokens, computed_tokens.

One formatter per choice (n > 1: choice `index`). A chat request whose output is parsed
for tool calls sends `delta.tool_calls` (router/tool_stream.py) and finishes with
"tool_calls" when the model called one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from modelinfo.tokenizer import Tokenizer
from protocol.messages import PromptUsage
from router.output import OutputDelta
from router.preprocess import PreparedRequest
from router.tool_stream import ToolStream

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
    """Builds one choice's parts of the response bodies. Holds back logprobs of tokens
    whose text is not out yet, so each chunk's logprobs match its text."""

    object_chunk = ""
    object_full = ""

    def __init__(self, req: PreparedRequest, tokenizer: Tokenizer, index: int = 0) -> None:
        self.req = req
        self.index = index
        self._tokenizer = tokenizer
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[float | None] = []
        self._pending_tops: list[list[tuple[int, float]] | None] = []
        self._text_offset = 0
        self._text = ""
        self._all_logprobs: list[Any] = []

    # -- streaming ------------------------------------------------------------------------

    def stream_start(self) -> bytes:
        """Bytes sent before the first delta (chat: the role chunk)."""
        return b""

    def stream_delta(self, delta: OutputDelta) -> bytes:
        """The SSE chunk for `delta`, or b"" when there is nothing to say yet."""
        self._collect(delta)
        choice = self._choice_delta(delta.text, delta.finish_reason)
        if choice is None:
            return b""
        return sse(self.envelope(self.object_chunk, [choice], stream=True))

    def stream_usage(self, num_completion: int, usage: PromptUsage | None) -> bytes:
        body = self.envelope(self.object_chunk, [], stream=True)
        body["usage"] = usage_dict(len(self.req.prompt_token_ids), num_completion, usage)
        return sse(body)

    # -- whole response -----------------------------------------------------------------------

    def add_delta(self, delta: OutputDelta) -> None:
        """Non-streaming: collect text and logprobs as deltas arrive."""
        if self.req.logprobs:
            self._collect(delta)
        self._text += delta.text

    def choice(self, finish_reason: str | None) -> dict[str, Any]:
        """This choice of the whole response, after every delta went to add_delta."""
        logprobs = self._take_logprobs() if self.req.logprobs else None
        return self._choice_full(self._text, logprobs, finish_reason)

    def response(
        self, text: str, finish_reason: str | None, num_completion: int, usage: PromptUsage | None
    ) -> bytes:
        """The whole body of a one-choice request (text: the choice's whole text)."""
        self._text = text
        return full_response([self], [finish_reason], num_completion, usage)

    # -- pieces -------------------------------------------------------------------------------

    def envelope(self, obj: str, choices: list[Any], stream: bool = False) -> dict[str, Any]:
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

    def _collect(self, delta: OutputDelta) -> None:
        if self.req.logprobs:
            self._pending_ids += delta.token_ids
            self._pending_logprobs += delta.logprobs
            tops = delta.top_logprobs or [None] * len(delta.token_ids)
            self._pending_tops += tops

    def _take_logprobs(self) -> Any:
        ids, lps, tops = self._pending_ids, self._pending_logprobs, self._pending_tops
        self._pending_ids, self._pending_logprobs, self._pending_tops = [], [], []
        tokens = [self._token_text(t) for t in ids]
        alternatives = [
            [(self._token_text(t), lp) for t, lp in top] if top is not None else None
            for top in tops
        ]
        return self._format_logprobs(tokens, lps, alternatives)

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _format_logprobs(
        self,
        tokens: list[str],
        logprobs: list[float | None],
        tops: list[list[tuple[str, float]] | None],
    ) -> Any:
        raise NotImplementedError

    def _choice_delta(self, text: str, finish: str | None) -> dict[str, Any] | None:
        raise NotImplementedError

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError


def full_response(
    formatters: list[ResponseFormatter],
    finish_reasons: list[str | None],
    num_completion: int,
    usage: PromptUsage | None,
) -> bytes:
    """The whole body of a request: one choice per formatter."""
    first = formatters[0]
    choices = [f.choice(r) for f, r in zip(formatters, finish_reasons, strict=True)]
    body = first.envelope(first.object_full, choices)
    body["usage"] = usage_dict(len(first.req.prompt_token_ids), num_completion, usage)
    return _encode(body)


class ChatFormatter(ResponseFormatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, req: PreparedRequest, tokenizer: Tokenizer, index: int = 0) -> None:
        super().__init__(req, tokenizer, index)
        self._tools = ToolStream(req.tool_parser) if req.tool_parser is not None else None
        self._streamed = ""

    def stream_start(self) -> bytes:
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse(self.envelope(self.object_chunk, [choice], stream=True))

    def _format_logprobs(
        self,
        tokens: list[str],
        logprobs: list[float | None],
        tops: list[list[tuple[str, float]] | None],
    ) -> Any:
        content = [
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top or ()
                ],
            }
            for t, lp, top in zip(tokens, logprobs, tops, strict=False)
        ]
        return {"content": content, "refusal": None}

    def _finish(self, finish: str | None) -> str | None:
        if finish == "stop" and self._tools is not None and self._tools.calls:
            return "tool_calls"
        return finish

    def _choice_delta(self, text: str, finish: str | None) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if self._tools is None:
            if text:
                delta["content"] = text
        else:
            self._streamed += text
            content, calls = self._tools.feed(self._streamed, final=finish is not None)
            if not self.req.parallel_tool_calls:
                calls = [c for c in calls if c["index"] == 0]
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
        if not delta and finish is None:
            return None
        logprobs = self._take_logprobs() if self.req.logprobs else None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": self._finish(finish),
        }

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self._tools is not None:
            self._tools.feed(text, final=True)
            calls = self._tools.calls if self.req.parallel_tool_calls else self._tools.calls[:1]
            message["content"] = self._tools.content or (None if calls else "")
            if calls:
                message["tool_calls"] = [c.as_dict() for c in calls]
        return {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish(finish),
        }


class CompletionFormatter(ResponseFormatter):
    object_chunk = "text_completion"
    object_full = "text_completion"

    def _format_logprobs(
        self,
        tokens: list[str],
        logprobs: list[float | None],
        tops: list[list[tuple[str, float]] | None],
    ) -> Any:
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        top = [dict(alternatives or ()) for alternatives in tops] if self.req.top_logprobs else None
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _choice_delta(self, text: str, finish: str | None) -> dict[str, Any] | None:
        if not text and finish is None:
            return None
        logprobs = self._take_logprobs() if self.req.logprobs else None
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _choice_full(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def formatter_for(req: PreparedRequest, tokenizer: Tokenizer, index: int = 0) -> ResponseFormatter:
    cls = ChatFormatter if req.kind == "chat" else CompletionFormatter
    return cls(req, tokenizer, index)

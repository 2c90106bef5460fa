"""OpenAI request bodies as msgspec structs (decoded on the hot path, no pydantic).

A top-level field kvserve does not serve is a 400 naming it (nothing is silently
ignored); inside messages, fields clients echo back from responses (refusal, annotations)
are ignored. Every known field accepts JSON null as "not given". Semantic checks (ranges,
unsupported values) live in router/preprocess.py, so decoding only rejects malformed
JSON, unknown fields and wrong types.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import InvalidRequest


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only {"type": "text", "text": ...} is served."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chat message; the fields chat templates read."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class GenerationFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool | None = None


class ChatCompletionRequest(GenerationFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(GenerationFields, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any]
    """A string, a list of token ids, or a one-element list of either."""
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(_chat_decoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(_completion_decoder, body)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """400 naming the field for a wrong type; 400 for malformed JSON."""
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise _type_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


def _type_error(text: str) -> InvalidRequest:
    """msgspec says "Expected `int`, got `str` - at `$.max_tokens`"; name the field."""
    message, sep, where = text.rpartition(" - at `")
    unknown = _unknown_field(message if sep else text)
    if unknown is not None:
        path = where.rstrip("`").removeprefix("$").removeprefix(".") if sep else ""
        field = f"{path}.{unknown}" if path else unknown
        return InvalidRequest(
            f"unsupported field `{field}`: kvserve does not serve it (docs/router.md lists "
            "the fields it does); remove it",
            param=field,
        )
    if not sep:
        if text.startswith("Expected `object`"):
            return InvalidRequest(f"the request body must be a JSON object ({text})")
        missing = _missing_field(text)
        if missing is not None:
            return InvalidRequest(f"missing required field `{missing}`", param=missing)
        return InvalidRequest(text)
    path = where.rstrip("`").removeprefix("$").removeprefix(".")
    missing = _missing_field(message)
    if missing is not None:
        field = f"{path}.{missing}" if path else missing
        return InvalidRequest(f"missing required field `{field}`", param=field)
    return InvalidRequest(f"invalid value for `{path}`: {message}", param=path or None)


def _unknown_field(text: str) -> str | None:
    """ "Object contains unknown field `foo`" -> "foo"."""
    if text.startswith("Object contains unknown field `"):
        return text.split("`")[1]
    return None


def _missing_field(text: str) -> str | None:
    """ "Object missing required field `messages`" -> "messages"."""
    if text.startswith("Object missing required field `"):
        return text.split("`")[1]
    return None

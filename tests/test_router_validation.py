"""Bad input never reaches a worker and never gets a 5xx: OpenAI-shaped 4xx errors that
name the field, and the router keeps serving afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from router_standin import RouterHarness

MAX_INPUT = 4000


@pytest.fixture(scope="module")
def h() -> Iterator[RouterHarness]:
    harness = RouterHarness(max_input_tokens=MAX_INPUT)
    yield harness
    harness.close()


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2-135m-instruct", "prompt": "hi", **fields}


CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
LONG = list(range(100, 100 + MAX_INPUT + 1))

# (path, body, status, param, code, words in the message)
CASES: list[tuple[str, Any, int, str | None, str | None, str]] = [
    (CHAT, b"{not json", 400, None, None, "not valid JSON"),
    (CHAT, b"", 400, None, None, "empty"),
    (CHAT, b"[1, 2]", 400, None, None, "JSON object"),
    (CHAT, b"\xff\xfe", 400, None, None, "JSON"),
    (CHAT, _chat(max_tokens="many"), 400, "max_tokens", None, "int"),
    (CHAT, _chat(temperature="hot"), 400, "temperature", None, "float"),
    (CHAT, _chat(stream="yes"), 400, "stream", None, "bool"),
    (CHAT, _chat(messages="hi"), 400, "messages", None, "array"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None, ""),
    (CHAT, _chat(messages=[{"content": "x"}]), 400, "messages[0].role", None, "missing"),
    (CHAT, {"model": "smollm2-135m-instruct"}, 400, "messages", None, "missing"),
    (CHAT, _chat(messages=[]), 400, "messages", None, "at least one"),
    (
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
        None,
        "wizard",
    ),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        "messages[0].content[0]",
        None,
        "text",
    ),
    (CHAT, _chat(model="gpt-4o"), 404, "model", "model_not_found", "gpt-4o"),
    (CHAT, _chat(max_tokens=0), 400, "max_tokens", None, "at least 1"),
    (CHAT, _chat(max_tokens=-5), 400, "max_tokens", None, "at least 1"),
    (CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens", None, "at least 1"),
    (CHAT, _chat(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded", "context length"),
    (CHAT, _chat(n=17), 400, "n", None, "n must be in [1, 16]"),
    (CHAT, _chat(n=0), 400, "n", None, "n must be in"),
    (CHAT, _chat(temperature=5), 400, "temperature", None, "temperature"),
    (CHAT, _chat(top_p=0), 400, "top_p", None, "top_p"),
    (CHAT, _chat(top_k=-3), 400, "top_k", None, "top_k"),
    (CHAT, _chat(min_tokens=50, max_tokens=10), 400, "min_tokens", None, "min_tokens"),
    (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None, "stop"),
    (CHAT, _chat(stop=[""]), 400, "stop", None, "stop"),
    (CHAT, _chat(stop=["x" * 1025]), 400, "stop", None, "1024 characters"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": ""}] * 10_001),
        400,
        "messages",
        None,
        "at most 10000",
    ),
    (CHAT, _chat(stop=5), 400, "stop", None, ""),
    (CHAT, _chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", None, "[0, 20]"),
    (CHAT, _chat(top_logprobs=3), 400, "top_logprobs", None, "logprobs=true"),
    (CHAT, _chat(frequency_penalty=2.5), 400, "frequency_penalty", None, "[-2, 2]"),
    (CHAT, _chat(presence_penalty=-3), 400, "presence_penalty", None, "[-2, 2]"),
    (CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty", None, "[0.0001, 2]"),
    (CHAT, _chat(repetition_penalty=5e-324), 400, "repetition_penalty", None, "0.0001"),
    (CHAT, _chat(logit_bias={"x": 1}), 400, "logit_bias", None, "token ids"),
    (CHAT, _chat(logit_bias={"5": 101}), 400, "logit_bias", None, "[-100, 100]"),
    (CHAT, _chat(logit_bias={"999999": 1}), 400, "logit_bias", None, "vocabulary"),
    (CHAT, _chat(best_of=2), 400, "best_of", None, "unsupported field `best_of`"),
    (CHAT, _chat(functions=[]), 400, "functions", None, "unsupported field"),
    (CHAT, _chat(response_format={"type": "yaml"}), 400, "response_format.type", None, "yaml"),
    (
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema",
        None,
        "schema",
    ),
    (
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
            }
        ),
        400,
        "response_format",
        None,
        "grammar",
    ),
    (CHAT, _chat(tool_choice="required"), 400, "tool_choice", None, "needs tools"),
    (CHAT, _chat(tools=[{"type": "web"}]), 400, "tools[0]", None, "function"),
    (
        CHAT,
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        None,
        "not in tools",
    ),
    (CHAT, _chat(tool_choice="sometimes"), 400, "tool_choice", None, "sometimes"),
    (CHAT, _chat(seed=2**70), 400, "seed", None, "64 bits"),
    (
        CHAT,
        _chat(stream_options={"include_usage": "x"}),
        400,
        "stream_options.include_usage",
        None,
        "",
    ),
    (
        COMPLETION,
        _completion(prompt=LONG),
        400,
        "prompt",
        "context_length_exceeded",
        str(MAX_INPUT),
    ),
    (  # text past 16 K characters: tokenized in a worker thread, then counted
        COMPLETION,
        _completion(prompt="hello " * 5000),
        400,
        "prompt",
        "context_length_exceeded",
        "has 5001 tokens",  # 5,000 "hello" and the last space
    ),
    (COMPLETION, _completion(prompt=""), 400, "prompt", None, "empty"),
    (COMPLETION, _completion(prompt=[]), 400, "prompt", None, "empty"),
    (COMPLETION, _completion(prompt=["a", "b"]), 400, "prompt", None, "batched"),
    (COMPLETION, _completion(prompt=[1, "a"]), 400, "prompt", None, "token ids"),
    (COMPLETION, _completion(prompt=[1, True]), 400, "prompt", None, "token ids"),
    (COMPLETION, _completion(prompt=[10**9]), 400, "prompt", None, "vocabulary"),
    (COMPLETION, _completion(prompt=5), 400, "prompt", None, ""),
    (COMPLETION, {"model": "smollm2-135m-instruct"}, 400, "prompt", None, "missing"),
    (COMPLETION, _completion(logprobs=21), 400, "logprobs", None, "[0, 20]"),
    (COMPLETION, _completion(tools=[]), 400, "tools", None, "unsupported field `tools`"),
    (COMPLETION, _completion(echo=True), 400, "echo", None, "echo"),
    (COMPLETION, _completion(stop_token_ids=[-1]), 400, "stop_token_ids", None, "vocabulary"),
    (COMPLETION, _completion(max_tokens=1.5), 400, "max_tokens", None, "int"),
    ("/v1/nothing", _completion(), 404, None, None, "no route"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code", "words"), CASES)
def test_bad_input_is_a_4xx_in_openai_shape(
    h: RouterHarness,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
    words: str,
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        h.url + path, content=content, trust_env=False, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["code"] == code, error
    assert words in error["message"], error


def test_wrong_method_is_405_in_openai_shape(h: RouterHarness) -> None:
    r = httpx.get(h.url + CHAT, trust_env=False)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request(h: RouterHarness) -> None:
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 16\]"):
        h.openai().chat.completions.create(
            model=h.served_name, messages=[{"role": "user", "content": "hi"}], n=30
        )
    with pytest.raises(openai.NotFoundError):
        h.openai().completions.create(model="nope", prompt="x")


def test_no_worker_saw_bad_input_and_router_still_serves(h: RouterHarness) -> None:
    for path, body, *_ in CASES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(h.url + path, content=content, trust_env=False)
    assert h.prefill[0].received == [] and h.decode[0].received == []
    metrics = httpx.get(h.url + "/metrics", trust_env=False).text
    assert 'status="5' not in metrics
    r = h.openai().chat.completions.create(
        model=h.served_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.choices[0].finish_reason in ("length", "stop")

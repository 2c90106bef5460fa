"""kvserve-edge's bodies (edge/src/openai.rs, edge/src/protocol.rs) against the router's
own code for the same values, through the binary's `openai` test driver:

- parse: every body the edge accepts, the router accepts too (Preprocessor over the real
  SmolLM2 tokenizer and template) with the same SamplingParams (msgspec's bytes), model,
  stream, usage, user and prompt; after tokenizing, `finalize` accepts exactly when the
  router does. A table of bodies, then a hypothesis sweep of valid and invalid ones.
- responses: SSE chunks, the usage chunk, whole bodies, error bodies and events byte for
  byte as router/openai_format.py, router/choices.py and router/errors.py write them.
- the worker protocol: DecodeRequest, PrefillRequest (the landing untouched: its
  capability still verifies), GenerateRequest, AbortRequest as msgspec encodes them, and
  the workers' events parsed.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_standin import smollm2_info

from protocol.kv_layout import KVLayout
from protocol.landing_capability import capability_key, mint, verify
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    ErrorEvent,
    FirstToken,
    GenerateRequest,
    LandingGrant,
    LandingInfo,
    PrefillRequest,
    PromptUsage,
    TokenBatch,
    encode_line,
)
from protocol.sampling import GrammarSpec, SamplingParams
from router.api_types import decode_chat, decode_completion
from router.choices import error_event
from router.errors import APIError, InvalidRequest, NotFound, WorkerError, WorkerFailed
from router.openai_format import DONE, formatter_for
from router.output import OutputDelta
from router.preprocess import PreparedRequest, Preprocessor, _message_dict
from router.request_body import Headers, UnsupportedMediaType, decode_json, read_json_body
from router.tools import tool_request

SERVED = "smol"


class Driver:
    """`kvserve-edge openai`: one JSON line in, one out."""

    def __init__(self, binary: Path) -> None:
        self.proc = subprocess.Popen(
            [str(binary), "openai"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )

    def ask(self, **op: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(op) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert not (isinstance(answer, dict) and "driver_error" in answer), answer
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def edge(edge_bin: Path) -> Iterator[Driver]:
    driver = Driver(edge_bin)
    yield driver
    driver.close()


class Router:
    """The router's preprocessing of one body, with its limits."""

    def __init__(self, max_input_tokens: int | None, max_output_tokens: int | None) -> None:
        self.model = smollm2_info()
        self.pre = Preprocessor(self.model, SERVED, max_input_tokens, max_output_tokens)
        self.max_input_tokens = max_input_tokens
        self.max_output_tokens = max_output_tokens
        self.loop = asyncio.new_event_loop()

    @property
    def served(self) -> list[str]:
        return [SERVED, self.model.source.spec, self.model.served_name]

    def prepare(self, endpoint: str, body: bytes) -> PreparedRequest | None:
        """The PreparedRequest, or None where the router answers an error."""
        pre = self.pre
        try:
            if endpoint == "chat":
                coro = pre.chat(decode_json(decode_chat, body))
            else:
                coro = pre.completion(decode_json(decode_completion, body))
            return self.loop.run_until_complete(coro)
        except APIError:
            return None

    def prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        """The router's token ids for a prompt as the edge parsed it."""
        pre = self.pre
        if "text" in prompt:
            return pre._prompt_encoder.encode(prompt["text"])
        if "token_ids" in prompt:
            return list(prompt["token_ids"])
        tools = tool_request(None, None, pre.tool_parser, pre.template_source, pre._tool_calls_id)
        template = self.model.chat_template
        assert template is not None
        text = template.render(tools.messages(prompt["messages"]), add_generation_prompt=True)
        return pre._prompt_encoder.encode(text, add_special_tokens=False)

    def finalize_limits(self, prompt_len: int) -> dict[str, Any]:
        limits: dict[str, Any] = {
            "prompt_len": prompt_len,
            "context_len": self.model.max_context_len,
            "vocab_size": self.model.config.vocab_size,
        }
        if self.max_input_tokens is not None:
            limits["max_input_tokens"] = self.max_input_tokens
        if self.max_output_tokens is not None:
            limits["max_output_tokens"] = self.max_output_tokens
        return limits


ROUTER_LIMITS = {"plain": (None, None), "limited": (40, 30)}
"""max_input_tokens, max_output_tokens of the routers compared with."""


@pytest.fixture(scope="module")
def routers() -> dict[str, Router]:
    return {name: Router(*limits) for name, limits in ROUTER_LIMITS.items()}


def check_body(edge: Driver, router: Router, endpoint: str, body: str) -> bool:
    """Whether the edge serves `body` natively; when it does, the router accepts it with
    the same request. Returns the edge's verdict."""
    parsed = edge.ask(op="parse", endpoint=endpoint, body=body, served=router.served)
    prepared = router.prepare(endpoint, body.encode())
    if parsed is None:
        return False
    ids = router.prompt_ids(parsed["prompt"])
    final = edge.ask(
        op="parse",
        endpoint=endpoint,
        body=body,
        served=router.served,
        finalize=router.finalize_limits(len(ids)),
    )
    assert final["finalized"] == (prepared is not None), (body, final, prepared)
    if prepared is None:
        return False
    assert ids == prepared.prompt_token_ids, body
    assert final["final_params_json"] == msgspec.json.encode(prepared.params).decode(), body
    assert parsed["model"] == prepared.model
    assert parsed["stream"] == prepared.stream
    assert parsed["include_usage"] == prepared.include_usage
    assert parsed["user"] == prepared.user
    assert parsed["skip_special_tokens"] == prepared.skip_special_tokens
    assert prepared.n == 1 and not prepared.logprobs and prepared.tool_parser is None
    assert prepared.params.grammar is None and not prepared.params.logit_bias
    if endpoint == "chat":
        decoded = decode_chat(body.encode())
        want = [_message_dict(i, m) for i, m in enumerate(decoded.messages)]
        assert parsed["prompt"]["messages"] == want, body
    return True


# -- parse: a table ---------------------------------------------------------------------------

NATIVE_COMPLETIONS = [
    '{"prompt": "Hello"}',
    '{"model": "smol", "prompt": "Hello", "max_tokens": 8, "temperature": 0}',
    '{"model": "builtin:smollm2-135m-instruct", "prompt": ["Hello"], "stream": true}',
    '{"prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true}}',
    '{"prompt": [[5, 6]], "seed": -9223372036854775808, "stop": "\\n"}',
    '{"prompt": "x", "stop": ["a", "b", "c", "d"], "top_p": 0.9, "top_k": -1, "seed": 18446744073709551615}',
    '{"prompt": "x", "presence_penalty": -0.0, "frequency_penalty": 2, "repetition_penalty": 0.0001}',
    '{"prompt": "x", "min_tokens": 3, "max_tokens": 3, "ignore_eos": true, "stop_token_ids": [2, 49151]}',
    '{"prompt": "x", "n": 1, "echo": false, "suffix": "", "best_of": 1, "logprobs": null}',
    '{"prompt": "x", "user": "u1", "skip_special_tokens": false, "logit_bias": {}}',
    '{"prompt": "x", "temperature": 1e-400, "top_p": 1E0, "stream": false}',
    '{"prompt": "x", "temperature": -0.0, "stream_options": {"include_usage": true, "x": [1]}}',
    ' {"prompt" : "x" , "max_tokens" : 8191 }\n',
    '{"prompt": "\\u00e9\\ud83d\\ude00", "stop": "\\ud83d\\ude00"}',
    '{"pro\\u006dpt": "x", "max_\\u0074okens": 4}',
]
NATIVE_CHATS = [
    '{"messages": [{"role": "user", "content": "Hi"}]}',
    '{"model": "smol", "messages": [{"role": "system", "content": "Be brief."}, '
    '{"role": "user", "content": "Hi"}], "max_completion_tokens": 5, "max_tokens": -3}',
    '{"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, '
    '{"type": "text", "text": "b", "cache_control": {}}]}, {"role": "user", "content": []}]}',
    '{"messages": [{"role": "user", "content": "Hi", "name": null, "refusal": null}, '
    '{"role": "assistant", "content": "Yo", "annotations": []}, {"role": "user", "content": "x"}], '
    '"logprobs": false, "top_logprobs": 0, "tools": null, "tool_choice": null, '
    '"parallel_tool_calls": false, "stream": true}',
]
PROXIED = [
    ("completion", '{"prompt": "x", "n": 2}'),
    ("completion", '{"prompt": "x", "logprobs": 1}'),
    ("completion", '{"prompt": "x", "logit_bias": {"5": 1.0}}'),
    ("completion", '{"prompt": "x", "response_format": {"type": "json_object"}}'),
    ("completion", '{"prompt": "x", "max_tokens": 1.0}'),
    ("completion", '{"prompt": "x", "max_tokens": 0}'),
    ("completion", '{"prompt": "x", "model": "other"}'),
    ("completion", '{"prompt": "x", "temperature": 2.0000001}'),
    ("completion", '{"prompt": "x", "stop": ["", "a"]}'),
    ("completion", '{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}'),
    ("completion", '{"prompt": "x", "top_p": 0}'),
    ("completion", '{"prompt": "x", "top_k": -2}'),
    ("completion", '{"prompt": "x", "seed": 18446744073709551616}'),
    ("completion", '{"prompt": "x", "repetition_penalty": 0.00009}'),
    ("completion", '{"prompt": "x", "min_tokens": 4, "max_tokens": 3}'),
    ("completion", '{"prompt": "x", "stream": 1}'),
    ("completion", '{"prompt": "x", "prompt": "y"}'),
    ("completion", '{"prompt": "x", "pro\\u006dpt": "y"}'),
    ("completion", '{"prompt": "x", "Max_tokens": 4}'),
    ("completion", '{"prompt": "x"} x'),
    ("completion", '{"prompt": "x", "foo": 1}'),
    ("completion", '{"prompt": [1, true]}'),
    ("completion", '{"prompt": [49152]}'),
    ("completion", '{"prompt": ["a", "b"]}'),
    ("completion", '{"prompt": []}'),
    ("completion", '{"prompt": ""}'),
    ("completion", '{"prompt": "x", "max_tokens": 8192}'),
    ("completion", '{"prompt": "x", "stop_token_ids": [49152]}'),
    ("completion", '{"prompt": "x", "echo": true}'),
    ("completion", "[]"),
    ("completion", ""),
    ("chat", '{"messages": []}'),
    ("chat", '{"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}'),
    ("chat", '{"messages": [{"role": "user", "content": null}]}'),
    ("chat", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    (
        "chat",
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        '"function": {"name": "f"}}]}',
    ),
    ("chat", '{"messages": [{"role": "user", "content": "x"}], "logprobs": true}'),
    ("chat", '{"messages": [{"role": "user", "content": "x"}], "prompt": "y"}'),
    ("chat", '{"messages": [{"role": "user", "content": "x", "role": "system"}]}'),
    ("chat", '{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}'),
]


@pytest.mark.parametrize("body", NATIVE_COMPLETIONS)
def test_plain_completions_are_native_and_equal_the_routers(
    edge: Driver, routers: dict[str, Router], body: str
) -> None:
    assert check_body(edge, routers["plain"], "completion", body)


@pytest.mark.parametrize("body", NATIVE_CHATS)
def test_plain_chats_are_native_and_equal_the_routers(
    edge: Driver, routers: dict[str, Router], body: str
) -> None:
    assert check_body(edge, routers["plain"], "chat", body)


@pytest.mark.parametrize(("endpoint", "body"), PROXIED)
def test_the_rest_is_proxied(
    edge: Driver, routers: dict[str, Router], endpoint: str, body: str
) -> None:
    assert not check_body(edge, routers["plain"], endpoint, body)


def test_router_limits_decide_after_tokenizing(edge: Driver, routers: dict[str, Router]) -> None:
    """max_input_tokens 40, max_output_tokens 30: the default max_tokens is capped at 30,
    more is proxied (the router's 400), a long prompt too."""
    limited = routers["limited"]
    assert check_body(edge, limited, "completion", '{"prompt": "Hello"}')
    assert not check_body(edge, limited, "completion", '{"prompt": "Hello", "max_tokens": 31}')
    assert not check_body(edge, limited, "completion", json.dumps({"prompt": "word " * 60}))
    parsed = edge.ask(
        op="parse",
        endpoint="completion",
        body='{"prompt": [1, 2]}',
        served=limited.served,
        finalize=limited.finalize_limits(2),
    )
    assert parsed["finalized"] and json.loads(parsed["final_params_json"])["max_tokens"] == 30


# -- parse: a sweep ---------------------------------------------------------------------------

LONG_STOP = json.dumps("x" * 1024)
COMMON_VALUES: dict[str, list[str]] = {
    "model": ['"smol"', '"smollm2-135m-instruct"', '"other"', "null", "1"],
    "max_tokens": [
        "1",
        "16",
        "0",
        "-1",
        "1.0",
        "8000",
        "8191",
        "8192",
        "18446744073709551616",
        '"5"',
        "true",
        "null",
    ],
    "temperature": [
        "0",
        "0.0",
        "-0.0",
        "0.7",
        "2",
        "2.0000000000000004",
        "-0.1",
        "1e-400",
        "1E0",
        "null",
        '"1"',
    ],
    "top_p": ["1", "0.5", "0", "-0.0", "1.0000001", "5e-324", "null"],
    "top_k": ["0", "-1", "-2", "50", "1.0", "9223372036854775808", "null"],
    "seed": [
        "0",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        "1.5",
        "null",
    ],
    "stop": [
        '"\\n"',
        '""',
        '["a", "b"]',
        '["a","b","c","d","e"]',
        '[""]',
        "[1]",
        LONG_STOP,
        json.dumps("x" * 1025),
        json.dumps("😀" * 1024),
        "[]",
        "null",
    ],
    "stop_token_ids": ["[]", "[2]", "[49151]", "[49152]", "[-1]", "[1.0]", "null"],
    "n": ["1", "2", "0", "null", "1.0"],
    "ignore_eos": ["true", "false", "1", "null"],
    "min_tokens": ["0", "3", "-1", "100000", "null"],
    "presence_penalty": ["0", "-0.0", "2", "2.1", "-2", "1.5", "null"],
    "frequency_penalty": ["0", "-2.0000001", "0.25", "null"],
    "repetition_penalty": ["1", "0.0001", "0.00009", "2", "0", "1.2", "null"],
    "logit_bias": ["{}", '{"1": 2}', "null", "[]"],
    "response_format": ['{"type": "text"}', "null"],
    "stream": ["true", "false", "null", "0"],
    "stream_options": [
        '{"include_usage": true}',
        '{"include_usage": false}',
        "{}",
        '{"include_usage": 1}',
        '{"x": [1, {}], "include_usage": true}',
        "null",
        "[]",
    ],
    "user": ['"u"', "null", "5"],
    "skip_special_tokens": ["true", "false", "null"],
    "unknown_field": ["1"],
}
CHAT_VALUES: dict[str, list[str]] = {
    "max_completion_tokens": ["1", "5", "0", "null", "2.0"],
    "logprobs": ["false", "true", "null", "0"],
    "top_logprobs": ["0", "1", "null", "21"],
    "tools": ["[]", "null"],
    "tool_choice": ['"none"', "null"],
    "parallel_tool_calls": ["true", "2", "null"],
}
COMPLETION_VALUES: dict[str, list[str]] = {
    "echo": ["false", "true", "null"],
    "suffix": ['""', '"x"', "null"],
    "best_of": ["1", "2", "null"],
    "logprobs": ["null", "0", "1"],
}
PROMPTS = [
    '"hello"',
    '""',
    "[1, 2, 3]",
    "[[1, 2]]",
    '["hi"]',
    "[]",
    "[[]]",
    "[49152]",
    "[-1]",
    "[true]",
    '["a", "b"]',
    "[1.0]",
    "[[1], [2]]",
    '"<|im_start|>x"',
    json.dumps("word " * 60),
    "null",
    "5",
]
MESSAGES = [
    '{"role": "user", "content": "Hi"}',
    '{"role": "system", "content": "  sys\\n"}',
    '{"role": "assistant", "content": "a"}',
    '{"role": "developer", "content": "d"}',
    '{"role": "tool", "content": "t"}',
    '{"role": "bot", "content": "b"}',
    '{"role": "user", "content": null}',
    '{"role": "user"}',
    '{"content": "x"}',
    '{"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}',
    '{"role": "user", "content": [{"type": "text", "text": null}]}',
    '{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}',
    '{"role": "user", "content": [{"text": "no type"}]}',
    '{"role": "user", "content": "x", "name": "n"}',
    '{"role": "assistant", "content": "x", "tool_calls": []}',
    '{"role": "user", "content": "x", "reasoning_content": null, "extra": {"a": 1}}',
    '{"role": "user", "content": 5}',
    '"not a message"',
]


@st.composite
def bodies(draw: st.DrawFn, endpoint: str) -> str:
    values = {**COMMON_VALUES, **(CHAT_VALUES if endpoint == "chat" else COMPLETION_VALUES)}
    chosen = draw(st.lists(st.sampled_from(sorted(values)), max_size=6, unique=True))
    members = [(k, draw(st.sampled_from(values[k]))) for k in chosen]
    if endpoint == "chat":
        messages = draw(st.lists(st.sampled_from(MESSAGES), min_size=0, max_size=4))
        if draw(st.booleans()) or not messages:  # mostly a plain conversation
            messages = [*messages[:2], MESSAGES[0]] if draw(st.booleans()) else [MESSAGES[0]]
        required = ("messages", "[" + ", ".join(messages) + "]")
    else:
        required = (
            "prompt",
            draw(st.sampled_from(PROMPTS[:5] if draw(st.booleans()) else PROMPTS)),
        )
    if draw(st.integers(0, 9)) > 0:
        members.insert(draw(st.integers(0, len(members))), required)
    if members and draw(st.integers(0, 19)) == 0:
        members.append(members[0])  # a key twice
    sep = draw(st.sampled_from([",", ", ", " ,\n"]))
    colon = draw(st.sampled_from([":", ": ", " : "]))
    return "{" + sep.join(f'"{k}"{colon}{v}' for k, v in members) + "}"


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_whatever_the_edge_accepts_the_router_serves_alike(
    edge: Driver, routers: dict[str, Router], endpoint: str
) -> None:
    seen = {"native": 0}

    # The same 250 bodies every run: most random chat bodies are refused, and a clean-clone
    # CI run once drew only 6 native ones (the bound below is what makes the sweep mean
    # anything, so it must not hang on the draw).
    @settings(
        max_examples=250,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(body=bodies(endpoint), limits=st.sampled_from(sorted(ROUTER_LIMITS)))
    def sweep(body: str, limits: str) -> None:
        seen["native"] += check_body(edge, routers[limits], endpoint, body)

    sweep()
    print(f"{endpoint}: {seen['native']} of the sweep's bodies served natively")
    assert seen["native"] > 10  # the sweep reached the native path, not just refusals


CONTENT_TYPES = [
    None,
    b"application/json",
    b"Application/JSON; charset=utf-8",
    b" application/json ;x",
    b"\x1fapplication/json\x0b",
    b"application/vnd.api+json",
    b"application/+JSON",
    b"+json",
    b"json",
    b"text/plain",
    b"application/json5",
    b"application/x-www-form-urlencoded",
    b"",
    b"application/json\xa0",
    b"\xe9application/json",
]


class _Headers:
    """What read_json_body reads of a request: its headers and body."""

    def __init__(self, content_type: bytes | None) -> None:
        raw = [] if content_type is None else [(b"content-type", content_type)]
        self.headers = Headers(raw)

    async def body(self) -> bytes:
        return b"{}"


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_content_types_as_the_router_reads_them(
    edge: Driver, routers: dict[str, Router], content_type: bytes | None
) -> None:
    """A body the router would refuse (415) for its Content-Type is never native; the
    edge judges only ASCII values, so a non-ASCII one is proxied whatever the router does."""
    loop = routers["plain"].loop
    try:
        loop.run_until_complete(read_json_body(_Headers(content_type)))  # type: ignore[arg-type]
        router_reads = True
    except UnsupportedMediaType:
        router_reads = False
    header = None if content_type is None else list(content_type)
    edge_reads = edge.ask(op="content_type", header=header)["json"]
    if content_type is not None and not content_type.isascii():
        assert not edge_reads
    else:
        assert edge_reads == router_reads, content_type


float_texts = st.one_of(
    st.floats(0, 2).map(repr),
    st.floats(0, 2).map(lambda x: f"{x:.17e}"),
    st.floats(0, 2).map(lambda x: f"{x:.25f}"),
    st.text("0123456789", min_size=1, max_size=30).map(lambda d: "0." + d),
    st.text("0123456789", min_size=1, max_size=30).map(lambda d: "1." + d),
    st.integers(0, 2).map(str),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(["temperature", "top_p", "presence_penalty", "repetition_penalty"]),
    text=float_texts,
)
def test_floats_read_as_python_reads_them(
    edge: Driver, routers: dict[str, Router], name: str, text: str
) -> None:
    """Long mantissas and exponents: the edge's float is the router's, bit for bit (the
    params' bytes would differ otherwise)."""
    check_body(edge, routers["plain"], "completion", f'{{"prompt": "x", "{name}": {text}}}')


# -- responses --------------------------------------------------------------------------------

TEXTS = ["Hello", "", " wörld 😀", 'q"uo\\te', "line\nbreak\ttab\x01\x1f\x7f", "<|im_end|>", "漢字"]


def _prepared(router: Router, endpoint: str, body: dict[str, Any]) -> PreparedRequest:
    prepared = router.prepare(endpoint, json.dumps(body).encode())
    assert prepared is not None
    prepared.request_id = "chatcmpl-0123abcd" if endpoint == "chat" else "cmpl-0123abcd"
    prepared.created = 1_700_000_123
    return prepared


def _usage_json(prompt: int, completion: int, details: PromptUsage | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "details": msgspec.to_builtins(details) if details is not None else None,
    }


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("details", [None, PromptUsage(9, 4, 3, 2)])
def test_stream_chunks_equal_the_routers(
    edge: Driver,
    routers: dict[str, Router],
    endpoint: str,
    include_usage: bool,
    details: PromptUsage | None,
) -> None:
    router = routers["plain"]
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": include_usage}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    prepared = _prepared(router, endpoint, body)
    fmt = formatter_for(prepared, router.model.tokenizer)
    deltas = [(t, None) for t in TEXTS] + [("", "stop")]
    want = []
    for i, (text, finish) in enumerate(deltas):
        delta = OutputDelta(text, [7], [None], finish)
        chunk = fmt.stream_delta(delta)
        want.append((fmt.stream_start() + chunk) if i == 0 else chunk)
    num_prompt = len(prepared.prompt_token_ids)
    end = fmt.stream_usage(11, details) if include_usage else b""
    got = edge.ask(
        op="stream",
        endpoint=endpoint,
        request_id=prepared.request_id,
        created=prepared.created,
        model=prepared.model,
        include_usage=prepared.include_usage,
        deltas=deltas,
        usage=_usage_json(num_prompt, 11, details),
    )
    assert [c.encode() for c in got["chunks"]] == want
    assert got["end"].encode() == end + DONE


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_whole_bodies_equal_the_routers(
    edge: Driver, routers: dict[str, Router], endpoint: str, finish: str
) -> None:
    router = routers["plain"]
    body: dict[str, Any] = {"prompt": "Hi"}
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}]}
    prepared = _prepared(router, endpoint, body)
    text = "".join(TEXTS)
    details = PromptUsage(5, 2, 1, 2)
    want = formatter_for(prepared, router.model.tokenizer).response(text, finish, 6, details)
    got = edge.ask(
        op="full",
        endpoint=endpoint,
        request_id=prepared.request_id,
        created=prepared.created,
        model=prepared.model,
        text=text,
        finish_reason=finish,
        usage=_usage_json(len(prepared.prompt_token_ids), 6, details),
    )
    assert got["bytes"].encode() == want


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest('bad "x"\n', param="max_tokens"),
        NotFound("no such model", param="model", code="model_not_found"),
        WorkerError(503, "decode instance lost"),
        WorkerFailed("the workers ended the stream without a finish reason"),
    ],
)
def test_errors_equal_the_routers(edge: Driver, error: APIError) -> None:
    got = edge.ask(
        op="error_body", message=error.message, type=error.type, param=error.param, code=error.code
    )
    assert got["bytes"].encode() == error.encode()
    if error.param is None:
        got = edge.ask(op="error_event", message=error.message, type=error.type, code=error.code)
        assert got["bytes"].encode() == error_event(error)


def test_request_ids_look_like_the_routers(edge: Driver) -> None:
    ids = {edge.ask(op="request_id", endpoint="chat")["id"] for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(
        r"cmpl-[0-9a-f]{32}", edge.ask(op="request_id", endpoint="completion")["id"]
    )


# -- the worker protocol ----------------------------------------------------------------------

floats = st.floats(allow_nan=False, allow_infinity=False)
sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**40),
    min_tokens=st.integers(0, 100),
    temperature=floats,
    top_p=floats,
    top_k=st.integers(-1, 2**62),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.lists(st.text(max_size=8), max_size=4).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=floats | st.sampled_from([1e-5, 1e-6, 1e15, 1e16, 1e-4, 0.7, -0.0]),
    logit_bias=st.lists(st.tuples(st.integers(0, 2**31), floats), max_size=3).map(tuple),
    grammar=st.none() | st.builds(GrammarSpec, kind=st.just("lark"), text=st.text(max_size=12)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    params=sampling_params,
    prompt=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    request_id=st.text(max_size=12),
)
def test_worker_requests_are_msgspecs_bytes(
    edge: Driver,
    routers: dict[str, Router],
    params: SamplingParams,
    prompt: list[int],
    request_id: str,
) -> None:
    sent = msgspec.json.encode(params).decode()
    for kind, struct in (("decode", DecodeRequest), ("generate", GenerateRequest)):
        want = struct(
            version=PROTOCOL_VERSION, request_id=request_id, prompt_token_ids=prompt, params=params
        )
        got = edge.ask(
            op="worker",
            kind=kind,
            request_id=request_id,
            prompt=prompt,
            params=json.loads(sent),
        )
        assert got["bytes"].encode() == msgspec.json.encode(want)
    want_prefill = PrefillRequest(
        version=PROTOCOL_VERSION,
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        landing=[],
    )
    got = edge.ask(
        op="worker", kind="prefill", request_id=request_id, prompt=prompt, params=json.loads(sent)
    )
    assert got["bytes"].encode() == msgspec.json.encode(want_prefill)


LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")


@pytest.mark.parametrize("ready", [True, False])
def test_prefill_carries_decodes_landing_untouched(edge: Driver, ready: bool) -> None:
    key = capability_key("secret")
    rid = "cmpl-42"
    infos = [
        mint(
            key,
            rid,
            LandingInfo(rank, "mooncake", "127.0.0.1:15001", 4096 * rank + 1, 1 << 20, LAYOUT),
            1.7e9 + 0.123,
        )
        for rank in range(2)
    ]
    event = DecodeReady(
        request_id=rid, landing=infos, notify_url="http://127.0.0.1:9/notify", incarnation="i1"
    )
    params = SamplingParams(max_tokens=5, temperature=0.7, stop=("\n",))
    got = edge.ask(
        op="worker",
        kind="prefill",
        request_id=rid,
        prompt=[1, 2, 3],
        params=msgspec.to_builtins(params),
        ready=encode_line(event).decode() if ready else None,
    )
    sent = msgspec.json.decode(got["bytes"].encode(), type=PrefillRequest)
    want = PrefillRequest(
        version=PROTOCOL_VERSION,
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        params=params,
        landing=event.landing if ready else [],
        notify_url=event.notify_url if ready else "",
    )
    assert got["bytes"].encode() == msgspec.json.encode(want)
    for info in sent.landing:
        verify(key, rid, info, now_s=1.7e9)
    # protocol 5: the same request sent beside decode's, and the grant that follows
    got = edge.ask(
        op="worker",
        kind="prefill_awaiting",
        request_id=rid,
        prompt=[1, 2, 3],
        params=msgspec.to_builtins(params),
    )
    awaiting = msgspec.structs.replace(want, landing=[], notify_url="", await_landing=True)
    assert got["bytes"].encode() == msgspec.json.encode(awaiting)
    got = edge.ask(op="worker", kind="grant", request_id=rid, ready=encode_line(event).decode())
    grant = LandingGrant(PROTOCOL_VERSION, rid, event.landing, event.notify_url)
    assert got["bytes"].encode() == msgspec.json.encode(grant)
    for info in msgspec.json.decode(got["bytes"].encode(), type=LandingGrant).landing:
        verify(key, rid, info, now_s=1.7e9)


@pytest.mark.parametrize("reason", ["client_disconnected", "error", "timeout", "finished"])
@pytest.mark.parametrize("contacted", [True, False])
def test_aborts_are_msgspecs_bytes(edge: Driver, reason: str, contacted: bool) -> None:
    got = edge.ask(
        op="worker",
        kind="abort",
        request_id="chatcmpl-x",
        reason=reason,
        prefill_contacted=contacted,
    )
    want = AbortRequest(request_id="chatcmpl-x", reason=reason, prefill_contacted=contacted)  # type: ignore[arg-type]
    assert got["bytes"].encode() == msgspec.json.encode(want)


def test_worker_events_parse(edge: Driver) -> None:
    usage = PromptUsage(10, 4, 2, 4)
    first = FirstToken(
        request_id="r",
        token_id=7,
        logprob=-0.5,
        usage=usage,
        finish_reason=None,
        top_logprobs=[(7, -0.5)],
    )
    got = edge.ask(op="event", line=encode_line(first).decode())
    assert got == {
        "type": "first_token",
        "request_id": "r",
        "token_id": 7,
        "usage": msgspec.to_builtins(usage),
        "finish_reason": None,
    }
    batch = TokenBatch(
        request_id="r",
        token_ids=[1, 2],
        logprobs=[None, -1.0],
        finish_reason="length",
        num_output_tokens=3,
    )
    got = edge.ask(op="event", line=encode_line(batch).decode())
    assert got == {
        "type": "tokens",
        "request_id": "r",
        "token_ids": [1, 2],
        "finish_reason": "length",
        "num_output_tokens": 3,
    }
    error = ErrorEvent(request_id="r", status=400, message="prompt too long")
    got = edge.ask(op="event", line=encode_line(error).decode())
    assert got == {"type": "error", "request_id": "r", "status": 400, "message": "prompt too long"}
    ready = DecodeReady(request_id="r", landing=[], notify_url="http://n")
    got = edge.ask(op="event", line=encode_line(ready).decode())
    assert got["type"] == "ready" and got["landing_raw"] == "[]" and got["incarnation"] == ""
    # reordered fields, the tag last
    got = edge.ask(op="event", line='{"request_id":"r","status":503,"message":"m","type":"error"}')
    assert got["type"] == "error" and got["status"] == 503
    for bad in [
        "",
        "{}",
        '{"type":"tokens","request_id":"r"}',
        '{"type":"what","request_id":"r"}',
        '{"type":"ready","request_id":"r","landing":{},"notify_url":""}',
    ]:
        assert "error" in edge.ask(op="event", line=bad), bad

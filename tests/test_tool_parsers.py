"""Tool-call parsers and their streaming: deltas fed at every split of the text add up to
exactly what the whole text parses to (router/tool_parsers.py's prefix contract)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.tool_parsers import PARSERS, pick_parser
from router.tool_prompt import forced_call_grammar, hermes_fallback
from router.tool_stream import ToolStream

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"unit": "c}"}}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
MISTRAL = (
    'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}]'
)


def _final(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolStream(PARSERS[parser_name])
    stream.feed(text, final=True)
    return stream.content, [(c.name, c.arguments) for c in stream.calls]


def _streamed(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolStream(PARSERS[parser_name])
    text = ""
    content = ""
    calls: dict[int, list[str]] = {}
    for k, piece in enumerate(pieces):
        text += piece
        new, deltas = stream.feed(text, final=k == len(pieces) - 1)
        content += new
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                entry[0] = d["function"]["name"]
            entry[1] += d["function"]["arguments"]
    return content, [(n, a) for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            "hermes",
            HERMES,
            "Let me check.",
            [
                ("get_weather", '{"city": "Paris", "opts": {"unit": "c}"}}'),
                ("get_time", "{}"),
            ],
        ),
        ("hermes", "no tools here <tool", "no tools here <tool", []),
        ("llama3_json", LLAMA, "", [("get_weather", '{"city": "Rome"}')]),
        ("llama3_json", "Hello {there}", "Hello {there}", []),
        ("mistral", MISTRAL, "ok", [("f", '{"a": [1, 2]}'), ("g", "{}")]),
    ],
)
def test_whole_and_streamed_agree(parser: str, text: str, content: str, calls: Any) -> None:
    assert _final(parser, text) == (content, calls)
    for args, _ in ((c[1], 0) for c in calls):
        json.loads(args)
    # every split into two, and one character at a time
    for cut in range(len(text) + 1):
        assert _streamed(parser, [text[:cut], text[cut:]]) == (content, calls), cut
    assert _streamed(parser, list(text)) == (content, calls)


def test_arguments_stream_in_fragments() -> None:
    stream = ToolStream(PARSERS["hermes"])
    text = ""
    fragments = 0
    for ch in HERMES:
        text += ch
        _, deltas = stream.feed(text, final=False)
        fragments += sum(1 for d in deltas if "id" not in d)
    assert fragments > 10


def test_parser_picked_from_template_or_config() -> None:
    assert pick_parser("{{ '<tool_call>' }}", None).name == "hermes"
    assert pick_parser("{{ '<|python_tag|>' }}", None).name == "llama3_json"
    assert pick_parser("[TOOL_CALLS]", None).name == "mistral"
    assert pick_parser("{{ messages }}", None).name == "hermes"
    assert pick_parser("[TOOL_CALLS]", "hermes").name == "hermes"


def test_hermes_fallback_renders_calls_and_results() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    out = hermes_fallback(messages, tools)
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_forced_grammar_accepts_its_call(parser: str) -> None:
    import llguidance

    fn = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    grammar = forced_call_grammar(PARSERS[parser], [fn], special_id=5)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    assert not error, messages


def test_cluster_yaml_router_tool_parser_reaches_the_router() -> None:
    from pathlib import Path

    import yaml

    from protocol.cluster import parse_cluster
    from protocol.config_errors import ConfigError
    from router.config import settings_from_cluster

    local = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local.yaml"
    raw = yaml.safe_load(local.read_text())
    assert settings_from_cluster(parse_cluster(raw)).tool_parser is None
    raw["router"]["tool_parser"] = "mistral"
    assert settings_from_cluster(parse_cluster(raw)).tool_parser == "mistral"
    raw["router"]["tool_parser"] = "xml"
    with pytest.raises(ConfigError, match="tool_parser"):
        parse_cluster(raw)

"""Tool calls, n choices and tool-history rendering through the router and the official
openai client, against stand-in workers (tests/router_standin.py) that answer a fixed
token sequence, with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from router_standin import RouterHarness

CALL_TEXT = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
    '"days": [1, 2]}}\n</tool_call>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def harness() -> Iterator[RouterHarness]:
    h = RouterHarness()
    yield h
    h.close()


def _answer(h: RouterHarness, text: str) -> None:
    h.reset()
    h.set_output([*h.info.tokenizer.encode(text), h.info.eos_token_ids[0]])


def _prompt_text(h: RouterHarness, k: int = 0) -> str:
    ids = h.prefill[0].received[k][1].prompt_token_ids
    return h.info.tokenizer.decode(ids, skip_special_tokens=False)


def _chat(h: RouterHarness, **kw: Any) -> Any:
    return h.openai().chat.completions.create(model=h.served_name, **kw)


def test_auto_tool_call_whole_and_streamed(harness: RouterHarness) -> None:
    h = harness
    _answer(h, CALL_TEXT)
    whole = _chat(h, messages=QUESTION, tools=TOOLS).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Sure."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Rome", "days": [1, 2]}'
    # SmolLM2's template has no tool support: the tools are described in a system turn.
    assert "<tools>" in _prompt_text(h) and '"name": "get_weather"' in _prompt_text(h)

    _answer(h, CALL_TEXT)
    content, name, args, finish, ids = "", "", "", None, []
    for chunk in _chat(h, messages=QUESTION, tools=TOOLS, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids += [d.id] if d.id else []
                name += (d.function.name or "") if d.function else ""
                args += (d.function.arguments or "") if d.function else ""
    assert (content, name, args, finish) == (
        "Sure.",
        "get_weather",
        call.function.arguments,
        "tool_calls",
    )
    assert len(ids) == 1 and ids[0].startswith("call_")


def test_tool_choice_none_leaves_text_alone(harness: RouterHarness) -> None:
    h = harness
    _answer(h, CALL_TEXT)
    choice = _chat(h, messages=QUESTION, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == CALL_TEXT
    assert not choice.message.tool_calls
    assert "<tools>" not in _prompt_text(h)


def test_forced_tool_choice_sends_a_grammar(harness: RouterHarness) -> None:
    h = harness
    _answer(h, CALL_TEXT)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    _chat(h, messages=QUESTION, tools=TOOLS, tool_choice=forced)
    grammar = h.prefill[0].received[0][1].params.grammar
    assert grammar is not None and grammar.kind == "lark"
    assert '\\"name\\": \\"get_weather\\"' in grammar.text and "%json" in grammar.text


def test_tool_history_reaches_the_prompt(harness: RouterHarness) -> None:
    h = harness
    _answer(h, "It is sunny.")
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    r = _chat(h, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny."
    assert r.choices[0].finish_reason == "stop"
    prompt = _prompt_text(h)
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})
    assert f"<tool_call>\n{call}\n</tool_call>" in prompt
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in prompt


def test_n_choices_whole_and_streamed(harness: RouterHarness) -> None:
    h = harness
    text = "Hello there."
    _answer(h, text)
    r = _chat(h, messages=QUESTION, n=3, seed=7, temperature=0.5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [text] * 3
    num = len(h.info.tokenizer.encode(text)) + 1
    assert r.usage.completion_tokens == 3 * num
    received = [m for kind, m in h.prefill[0].received if kind == "prefill"]
    assert sorted(m.params.seed for m in received) == [7, 8, 9]
    assert sorted(m.request_id.rsplit("-", 1)[-1] for m in received[1:]) == ["1", "2"]

    _answer(h, text)
    texts = ["", "", ""]
    finishes = [None, None, None]
    usage = None
    for chunk in _chat(
        h, messages=QUESTION, n=3, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [text] * 3 and finishes == ["stop"] * 3
    assert usage is not None and usage.completion_tokens == 3 * num

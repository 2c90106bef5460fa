"""Tools into the prompt, and the grammar that forces a tool call.

Rendering: a chat template that knows tools gets them (`tools=`) and the messages as
transformers' templates expect them (assistant `tool_calls[].function.arguments` as a
dict, not OpenAI's JSON string). A template that never mentions tools (SmolLM2's, say)
would drop them silently; for it the tools are described in a system message in Hermes'
format, past calls become `<tool_call>` blocks in the assistant's content and tool
results `<tool_response>` blocks in a user turn, so the model sees the whole exchange.

Forcing (`tool_choice` "required" or a named function): a Lark grammar (llguidance's
dialect) that spells the parser's call format around a `%json` rule per function, so the
arguments are valid JSON for the function's parameter schema.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.grammar import JSON_STYLE
from router.tool_parsers import ToolParser

_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(template_source: str) -> bool:
    return "tools" in template_source


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def for_tool_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as tool-aware HF templates read them (arguments as objects)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c.get("function", {}),
                        "arguments": _arguments_dict(c.get("function", {}).get("arguments", {})),
                    },
                }
                for c in calls
            ]
        out.append(m)
    return out


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    args = _arguments_dict(function.get("arguments", {}))
    body = json.dumps({"name": function.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_fallback(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support, in Hermes' format (see above)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + body
            else:
                out.append({"role": "user", "content": body, "tool_responses": True})
        else:
            out.append({**m, "content": m.get("content") or ""})
    for m in out:
        m.pop("tool_responses", None)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = _HERMES_SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text)


def forced_call_grammar(
    parser: ToolParser, functions: list[dict[str, Any]], special_id: int | None = None
) -> str:
    """A Lark grammar whose only sentences are one call of one of `functions` in the
    parser's format. `special_id`: the id of Mistral's [TOOL_CALLS] token."""
    rules = []
    names = []
    for k, fn in enumerate(functions):
        schema = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        schema["x-guidance"] = JSON_STYLE
        name = fn["name"]
        if parser.name == "llama3_json":
            head, tail = f'{{"name": {json.dumps(name)}, "parameters": ', "}"
        elif parser.name == "mistral":
            head, tail = f'[{{"name": {json.dumps(name)}, "arguments": ', "}]"
        else:
            head, tail = (
                f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                "}\n</tool_call>",
            )
        rules.append(f"call_{k}: {_lark_string(head)} args_{k} {_lark_string(tail)}")
        rules.append(f"args_{k}: %json {json.dumps(schema)}")
        names.append(f"call_{k}")
    start = " | ".join(names)
    if parser.name == "mistral" and special_id is not None:
        start = f"<[{special_id}]> ({start})"
    return "\n".join([f"start: {start}", *rules]) + "\n"

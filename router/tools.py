"""`tools` + `tool_choice` of a chat request -> how to render, constrain and parse it.

    tool_choice   tools in the prompt   output parsed for calls   grammar
    none          no                    no                        -
    auto          yes                   yes                       -
    required      yes                   yes                       one call of any tool
    {function}    yes                   yes                       one call of that tool

Without `tools`, tool_choice may only be "none" (or absent). Tool-call history in the
messages (assistant tool_calls, role "tool" results) is rendered in every case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.sampling import GrammarSpec
from router.errors import InvalidRequest
from router.tool_parsers import ToolParser
from router.tool_prompt import (
    for_tool_template,
    forced_call_grammar,
    hermes_fallback,
    template_knows_tools,
)


@dataclass
class ToolRequest:
    parser: ToolParser | None
    """Parse the output for calls (None: plain content)."""
    grammar: GrammarSpec | None
    template_tools: list[dict[str, Any]] | None
    """What the chat template gets as `tools` (None when it cannot use them)."""
    prompt_tools: list[dict[str, Any]] | None
    """Tools described in a system message (a template without tool support)."""
    template_knows_tools: bool

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.template_knows_tools:
            return for_tool_template(messages)
        return hermes_fallback(messages, self.prompt_tools)


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}',
                param=f"tools[{i}]",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(
                f"tools[{i}].function.name must be a non-empty string",
                param=f"tools[{i}].function.name",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
        out.append(fn)
    return out


def _choice(tool_choice: str | dict[str, Any] | None, has_tools: bool) -> str:
    """ "none" | "auto" | "required" | "function:<name>"."""
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice {tool_choice!r} is not none, auto, required or a function",
                param="tool_choice",
            )
        return tool_choice
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequest(
            'tool_choice must be {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = fn.get("name")
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice.function.name must be a string", param="tool_choice")
    return f"function:{name}"


def tool_request(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parser: ToolParser,
    template_source: str,
    tool_calls_token_id: int | None,
) -> ToolRequest:
    """Validate `tools` / `tool_choice` (400s name the field) and plan the request."""
    functions = _functions(tools or [])
    choice = _choice(tool_choice, bool(functions))
    knows = template_knows_tools(template_source)
    if not functions:
        if choice != "none":
            raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolRequest(None, None, None, None, knows)
    if choice == "none":
        return ToolRequest(None, None, None, None, knows)
    grammar = None
    if choice != "auto":
        chosen = functions
        if choice.startswith("function:"):
            name = choice.removeprefix("function:")
            chosen = [fn for fn in functions if fn["name"] == name]
            if not chosen:
                raise InvalidRequest(
                    f"tool_choice names function {name!r}, which is not in tools",
                    param="tool_choice",
                )
        if parser.name == "mistral" and tool_calls_token_id is None:
            raise InvalidRequest(
                "this model's tokenizer has no [TOOL_CALLS] token to force a call with",
                param="tool_choice",
            )
        grammar = GrammarSpec(
            kind="lark", text=forced_call_grammar(parser, chosen, tool_calls_token_id)
        )
    return ToolRequest(
        parser,
        grammar,
        tools if knows else None,
        None if knows else list(tools or []),
        knows,
    )

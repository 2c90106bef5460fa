"""Tool-call parsers: a model's text -> content and tool calls, for the common formats.

    hermes       Hermes / Qwen:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.x:      [<|python_tag|>]{"name": ..., "parameters": {...}}
    mistral      Mistral:        text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

`parse(text, final)` is called on the whole text so far, every time. Its contract, which
streaming relies on (router/tool_stream.py): for a text t and any extension t' of it,
parse(t, False) is a prefix of parse(t', ...) — the content is a prefix, the calls are a
prefix, each call's name is either still unknown (None) or final, and its arguments a
prefix. So what was streamed never has to be taken back, and the streamed deltas add up
to exactly the non-streamed result. Text that might still turn into a marker (a partial
"<tool_call", trailing whitespace, the closing braces of a call) is held back until the
next token or the end decides it.

Arguments are the model's raw JSON text (OpenAI's `arguments` is a string the model
wrote; it is not re-serialized, so streamed fragments and the whole agree byte for byte).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_WHITESPACE = " \t\r\n"


@dataclass
class ParsedCall:
    name: str | None
    """None while the name is not complete yet (streaming)."""
    arguments: str = ""


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """Parses one format; stateless (one instance serves every request)."""

    name = ""
    needs_special_tokens = False
    """The format's marker is a special token: detokenize without skipping specials."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`, the whole output so far (the prefix contract of
        the module docstring)."""


def _hold_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` without trailing whitespace and without a trailing partial marker."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut].rstrip(_WHITESPACE)


def parse_call_body(body: str, complete: bool) -> ParsedCall | None:
    """One `{"name": ..., "arguments"|"parameters": {...}}` object, possibly unfinished.
    None: a complete body that is not a call."""
    head = _CALL_HEAD.match(body)
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        rest = body[head.end() :]
        if complete:
            args = rest.rstrip(_WHITESPACE)
            if args.endswith("}"):  # the call object's own closing brace
                args = args[:-1].rstrip(_WHITESPACE)
        else:  # any trailing "}" may be the call's own: hold them back
            args = rest.rstrip(_WHITESPACE + "}")
        return ParsedCall(name, args)
    if not complete:
        return ParsedCall(None)
    try:  # keys in another order: only a finished object tells
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    value = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], value if isinstance(value, str) else json.dumps(value))


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(self.START)
        if first < 0:
            return ParsedOutput(text if final else _hold_partial(text, (self.START,)))
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start : end if end >= 0 else len(text)]
            if end < 0 and not final:
                body = _hold_partial(body, (self.END,))
            call = parse_call_body(body, complete=end >= 0 or final)
            if call is not None:
                calls.append(call)
            if end < 0 or (call is not None and call.name is None):
                break
            pos = text.find(self.START, end + len(self.END))
        return ParsedOutput(text[:first].rstrip(_WHITESPACE), calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip(_WHITESPACE)
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip(_WHITESPACE)
            if not body and not final:
                return ParsedOutput("")  # the tag: a call follows
        elif not final and self.TAG.startswith(body):
            return ParsedOutput("")  # maybe the tag; maybe nothing yet
        if not body.startswith("{"):
            return ParsedOutput(text if final else text.rstrip(_WHITESPACE))
        calls: list[ParsedCall] = []
        for k, part in enumerate(body.split(";")):
            last = k == len(body.split(";")) - 1
            call = parse_call_body(part, complete=final or not last)
            if call is None:
                if final and not calls:
                    return ParsedOutput(text)  # JSON-looking text, not a call
                continue
            calls.append(call)
            if call.name is None:
                break
        return ParsedOutput("", calls)


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = text.find(self.MARKER)
        if i < 0:
            return ParsedOutput(text if final else _hold_partial(text, (self.MARKER,)))
        content = text[:i].rstrip(_WHITESPACE)
        if not final:  # the array is parsed once, when it is complete
            return ParsedOutput(content)
        try:
            items = json.loads(text[i + len(self.MARKER) :])
        except ValueError:
            return ParsedOutput(content)
        calls = []
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = item.get("arguments", {})
                calls.append(
                    ParsedCall(item["name"], args if isinstance(args, str) else json.dumps(args))
                )
        return ParsedOutput(content, calls)


PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())
}


def pick_parser(template_source: str | None, configured: str | None) -> ToolParser:
    """cluster.yaml's router.tool_parser when set; else what the chat template speaks
    (Hermes for a template without tool support: router/tool_prompt.py then renders the
    tools in Hermes' format itself)."""
    if configured:
        return PARSERS[configured]
    source = template_source or ""
    if "[TOOL_CALLS]" in source:
        return PARSERS["mistral"]
    if "<|python_tag|>" in source or "ipython" in source:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]

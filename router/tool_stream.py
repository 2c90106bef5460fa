"""Tool calls of one choice as OpenAI deltas: the diff between successive parses.

Fed the whole text so far after every delta, it returns what is new since the last
feed: a content fragment and tool-call deltas (the first delta of a call carries its
index, id, type and name; later ones argument fragments). The non-streamed response
uses the same object fed once with final=True, so both agree by construction
(router/tool_parsers.py states the prefix contract the diff relies on).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from router.tool_parsers import ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolStream:
    parser: ToolParser
    content_sent: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, new tool-call deltas) for the text so far."""
        parsed = self.parser.parse(text, final)
        new_content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        self.content += new_content
        deltas: list[dict[str, Any]] = []
        for k, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if k == len(self.calls):
                self.calls.append(ToolCall(new_call_id(), call.name, call.arguments))
                deltas.append(
                    {
                        "index": k,
                        "id": self.calls[k].id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            sent = self.calls[k]
            fragment = call.arguments[len(sent.arguments) :]
            if fragment:
                sent.arguments += fragment
                deltas.append({"index": k, "function": {"arguments": fragment}})
        return new_content, deltas

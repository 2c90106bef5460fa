"""GrammarSpec -> llguidance grammar text, and its validation (torch-free: the router
checks specs before sending them, the engine compiles them)."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from protocol.sampling import GrammarSpec

JSON_STYLE: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""JSON is generated in json.dumps' style: free whitespace lets a sampled model wander into
runs of blanks until max_tokens cuts the JSON short. Lark grammars embedding `%json` put
the same options under the schema's "x-guidance" key."""


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec. Raises ValueError for a schema that is not a
    JSON object."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_STYLE
        )
    if spec.kind == "json_schema":
        schema = json.loads(spec.text)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    return llguidance.LLMatcher.grammar_from_lark(spec.text)


def check_grammar(spec: GrammarSpec) -> str | None:
    """None when the spec compiles, else llguidance's error (no tokenizer needed)."""
    try:
        text = grammar_text(spec)
    except ValueError as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return messages[0] if is_error else None

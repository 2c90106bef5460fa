"""The model's tokenizer for kvserve-edge (docs/edge.md, "Token work"): the file it loads
and whether its tokenizer can give the router's ids for it.

The edge reads Hugging Face tokenizer.json (the backend's own serialization, so a GGUF
model's rebuilt tokenizer is written the same way) and implements byte-level BPE only
(an NFC normalizer only for texts it leaves unchanged; it declines the others per request):
`edge_can_tokenize` names the first thing outside that, and then the edge serves nothing
natively for the model. edge/src/tokenizer/load.rs checks the same forms (and refuses a
split regex it cannot compile).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelinfo.tokenizer import Tokenizer


def write_tokenizer_json(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write what the edge loads: the backend's tokenizer.json (post-processor and added
    tokens as the router uses them)."""
    Path(path).write_text(tokenizer.backend.to_str(), encoding="utf-8")


def edge_can_tokenize(tokenizer: Tokenizer) -> str | None:
    """None when the edge's tokenizer gives this tokenizer's ids; else why not."""
    return unsupported_form(json.loads(tokenizer.backend.to_str()))


def unsupported_form(spec: dict[str, Any]) -> str | None:
    """The first part of a tokenizer.json (parsed) outside the edge's forms, or None."""
    for key in ("truncation", "padding"):
        if spec.get(key) is not None:
            return f"{key} {_kind(spec[key])} is not supported (only null)"
    normalizer = spec.get("normalizer")
    if normalizer is not None and _kind(normalizer) != "NFC":
        return f"normalizer {_kind(normalizer)} is not supported (only null and NFC)"
    if _kind(spec.get("decoder")) != "ByteLevel":
        return f"decoder {_kind(spec.get('decoder'))} is not supported (only ByteLevel)"
    return (
        _pre_tokenizer_reason(spec.get("pre_tokenizer"))
        or _model_reason(spec.get("model") or {})
        or _added_tokens_reason(spec.get("added_tokens") or [])
        or _post_processor_reason(spec.get("post_processor"))
    )


def _kind(part: Any) -> str:
    return str(part.get("type")) if isinstance(part, dict) else repr(part)


def _pre_tokenizer_reason(pre: Any) -> str | None:
    steps = pre.get("pretokenizers") if _kind(pre) == "Sequence" else [pre]
    ok = (
        isinstance(steps, list)
        and steps
        and _kind(steps[-1]) == "ByteLevel"
        and all(_kind(s) == "Split" for s in steps[:-1])
    )
    if not ok:
        return (
            f"pre_tokenizer {_kind(pre)} is not supported (only ByteLevel, or a Sequence of "
            "Split steps ending in ByteLevel)"
        )
    return None


def _model_reason(model: dict[str, Any]) -> str | None:
    if model.get("type", "BPE") != "BPE":
        return f"model {model.get('type')!r} is not supported (only BPE)"
    if model.get("dropout") not in (None, 0.0):
        return f"BPE dropout {model['dropout']} is not supported"
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE {key} is not supported"
    if model.get("byte_fallback"):
        return "BPE byte_fallback is not supported"
    return None


def _added_tokens_reason(added: list[dict[str, Any]]) -> str | None:
    for token in added:
        for key in ("single_word", "lstrip", "rstrip"):
            if token.get(key):
                return f"added token {token.get('content')!r} has {key}: not supported"
    return None


def _post_processor_reason(post: Any) -> str | None:
    steps = post.get("processors") if _kind(post) == "Sequence" else [post]
    for step in steps or []:
        if step is not None and _kind(step) not in ("ByteLevel", "TemplateProcessing"):
            return (
                f"post_processor {_kind(step)} is not supported (only ByteLevel, "
                "TemplateProcessing)"
            )
    return None

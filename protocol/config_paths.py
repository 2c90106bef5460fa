"""msgspec's type errors on cluster.yaml ("Expected `int` >= 1 - at `$.decode[0].port`") as
ConfigErrors that name the key path the way the YAML file spells it and say what is valid."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Union

import msgspec

from protocol.cluster_types import BYTE_SIZE_HELP, ByteSize
from protocol.config_errors import ConfigError

_AT_RE = re.compile(r"^(.*) - at `\$(.*)`$", re.S)
_TOKEN_RE = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def translate_validation_error(
    e: msgspec.ValidationError, root: type, data: object, source: str | None
) -> ConfigError:
    """A ConfigError naming the key path of a msgspec type error and what is valid;
    `data` is the raw YAML value that failed to convert to `root`."""
    text = str(e)
    m = _AT_RE.match(text)
    where, msg = (m.group(2), m.group(1)) if m else ("", text)
    tokens: list[str | int] = [name if name else int(idx) for name, idx in _TOKEN_RE.findall(where)]
    path = _format_path(tokens)
    tp = _type_at(root, tokens)
    unknown = re.match(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        struct = _struct_of(tp)
        valid = ", ".join(f.name for f in msgspec.structs.fields(struct)) if struct else "?"
        return ConfigError(
            _join(path, unknown.group(1)), f"unknown key; valid keys: {valid}", source
        )
    missing = re.match(r"Object missing required field `(.+)`", msg)
    if missing:
        field_tp = _type_at(root, [*tokens, missing.group(1)])
        hint = _describe(field_tp)
        return ConfigError(
            _join(path, missing.group(1)),
            "required key is missing" + (f"; expected {hint}" if hint else ""),
            source,
        )
    message = msg[:1].lower() + msg[1:]
    message = message.replace("invalid enum value", "invalid value")
    found, value = _value_at(data, tokens)
    if found and "got" not in message and "value" not in message:
        message += f", got {value!r}"
    hint = _describe(tp)
    if hint and hint not in message:
        message += f" (valid: {hint})"
    return ConfigError(path, message, source)


def _value_at(data: object, tokens: list[str | int]) -> tuple[bool, object]:
    """(found, value) of the raw YAML value at a key path."""
    for tok in tokens:
        in_dict = isinstance(tok, str) and isinstance(data, dict) and tok in data
        in_list = isinstance(tok, int) and isinstance(data, list) and tok < len(data)
        if not (in_dict or in_list):
            return False, None
        data = data[tok]  # type: ignore[index]
    return True, data


def _format_path(tokens: list[str | int]) -> str:
    out = ""
    for t in tokens:
        out += f"[{t}]" if isinstance(t, int) else (f".{t}" if out else t)
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """(type without Annotated, its metadata)."""
    meta: list[Any] = []
    while typing.get_origin(tp) is typing.Annotated:
        meta.extend(tp.__metadata__)
        tp = tp.__origin__
    return tp, meta


def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union (None left out), each with its Annotated metadata."""
    base, _ = _strip(tp)
    if typing.get_origin(base) in (Union, types.UnionType):
        return tuple(a for a in typing.get_args(base) if a is not type(None))
    return (tp,)


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    for m in _members(tp):
        m, _ = _strip(m)
        if isinstance(m, type) and issubclass(m, msgspec.Struct):
            return m
    return None


def _type_at(root: Any, tokens: list[str | int]) -> Any:
    """The declared type at a key path (None if it cannot be followed)."""
    tp = root
    for tok in tokens:
        if isinstance(tok, str):
            struct = _struct_of(tp)
            if struct is None:
                return None
            hints = typing.get_type_hints(struct, include_extras=True)
            tp = hints.get(tok)
        else:
            inner = None
            for m in _members(tp):
                args = typing.get_args(_strip(m)[0])
                if typing.get_origin(_strip(m)[0]) in (tuple, list) and args:
                    inner = args[0]
            tp = inner
        if tp is None:
            return None
    return tp


def _describe(tp: Any) -> str:
    """What a valid value of `tp` looks like, for error messages."""
    if tp is None:
        return ""
    parts: list[str] = []
    for m in _members(tp):
        base, meta = _strip(m)
        descs = [x.description for x in meta if isinstance(x, msgspec.Meta) and x.description]
        if descs:
            parts.append(descs[0])
        elif typing.get_origin(base) is Literal:
            parts.append("one of " + ", ".join(str(a) for a in typing.get_args(base)))
        elif base is ByteSize:
            parts.append(BYTE_SIZE_HELP)
    if any(a is type(None) for a in typing.get_args(_strip(tp)[0])):
        parts.append("null")
    return " or ".join(dict.fromkeys(parts))

"""Value types of cluster.yaml: byte sizes, ports, names, devices, and their parsing.

Constrained types carry a `description` in their msgspec.Meta; the loader quotes it in
error messages, so it says what a valid value looks like.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec


class ByteSize(int):
    """A size in bytes. cluster.yaml accepts an integer or a string with a unit:
    "512MiB", "1GiB", "1.5 GiB" (binary: KiB, MiB, GiB, TiB) or "4GB" (decimal: KB, MB,
    GB, TB); a bare number or "B" is bytes."""

    def __repr__(self) -> str:
        return f"ByteSize({format_bytes(self)!r})"


BYTE_SIZE_HELP = 'a size such as "512MiB", "1GiB", "4GB" or an integer number of bytes'

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: object) -> ByteSize:
    """Parse an int or a unit string into bytes; ValueError says what is valid."""
    if isinstance(value, bool):
        raise ValueError(f"expected {BYTE_SIZE_HELP}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative (got {value})")
        return ByteSize(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            number, unit = m.group(1), m.group(2).lower()
            scale = _UNITS[unit]
            if "." in number:
                whole, frac = number.split(".")
                # Exact arithmetic: "1.5GiB" must not pick up float rounding.
                num = int(whole + frac) * scale
                den = 10 ** len(frac)
                if num % den:
                    raise ValueError(f"{value!r} is not a whole number of bytes")
                return ByteSize(num // den)
            return ByteSize(int(number) * scale)
    raise ValueError(f"expected {BYTE_SIZE_HELP}, got {value!r}")


def format_bytes(num_bytes: int) -> str:
    """Largest binary unit that shows the size exactly, else one decimal: "512MiB"."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= scale:
            if num_bytes % scale == 0:
                return f"{num_bytes // scale}{unit}"
            return f"{num_bytes / scale:.1f}{unit}"
    return f"{num_bytes}B"


def dec_hook(tp: type, obj: Any) -> Any:
    """msgspec hook for the custom types of cluster.yaml."""
    if tp is ByteSize:
        return parse_byte_size(obj)
    raise NotImplementedError(f"no decoder for {tp}")


def enc_hook(obj: Any) -> Any:
    """msgspec hook to write a config back out (sizes as plain integers)."""
    if isinstance(obj, ByteSize):
        return int(obj)
    raise NotImplementedError(f"no encoder for {type(obj)}")


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"

Port = Annotated[int, msgspec.Meta(ge=1, le=65535, description="a TCP port, 1-65535")]
Name = Annotated[
    str,
    msgspec.Meta(
        pattern=NAME_PATTERN,
        description="a name of letters, digits, '_', '.', '-' (starting with a letter or "
        "digit); it names log files and processes",
    ),
]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, description="an integer >= 1")]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, description="an integer >= 0")]
Fraction = Annotated[
    float, msgspec.Meta(gt=0.0, le=1.0, description="a number in (0, 1], e.g. 0.9")
]
Seconds = Annotated[float, msgspec.Meta(gt=0.0, description="a duration in seconds, > 0")]
Device = (
    Annotated[int, msgspec.Meta(ge=0, description='a GPU index >= 0, "cuda:N" or "cpu"')]
    | Annotated[str, msgspec.Meta(description='a GPU index >= 0, "cuda:N" or "cpu"')]
)
"""One device of an instance: a GPU index (4), "cuda:4", or "cpu"."""

_CUDA_RE = re.compile(r"^cuda:(\d+)$")


def device_name(device: int | str) -> str | None:
    """The torch device string of a cluster.yaml device ("cuda:4", "cpu"), None if invalid."""
    if isinstance(device, int):
        return f"cuda:{device}" if device >= 0 else None
    if device == "cpu":
        return "cpu"
    m = _CUDA_RE.match(device)
    return f"cuda:{int(m.group(1))}" if m else None


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every cluster.yaml section: immutable, unknown keys are errors."""

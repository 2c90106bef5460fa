"""The messages of the native data plane's control socket (kvserve-edge <-> the router).

router/edge_control.py's docstring lists them with their answers and rules;
edge/src/control.rs is the other side (serde_json, the same JSON). A frame is a 4-byte
little-endian length and one JSON object; edge -> router messages are tagged by "op".
Asks carry a "seq" that their answer echoes; reports are one-way.
"""

from __future__ import annotations

import struct

import msgspec

from protocol.messages import PromptUsage

WIRE_VERSION = 1
MAX_FRAME_BYTES = 256 << 20
"""A frame larger than this is a broken peer (a 1 M-token prompt is ~8 MB)."""
FRAME_HEADER = struct.Struct("<I")


class Ask(msgspec.Struct, tag_field="op", kw_only=True):
    """An ask: answered {"seq"}, {"seq", "instance"} or {"seq", "error"}."""

    seq: int


class Admit(Ask, tag="admit"):
    """A decode instance with KV headroom, waiting up to `deadline_s` in the admission
    gate's line; `tried`: instances this run could not reach."""

    id: str
    deadline_s: float
    tried: list[str] = []


class Pick(Ask, tag="pick"):
    """A prefill or unified instance (`role`); the prompt is its queued work from now."""

    id: str
    role: str
    tried: list[str] = []


class Ping(Ask, tag="ping"):
    """Answered once every earlier message was applied."""


class Report(msgspec.Struct, tag_field="op", kw_only=True):
    """A one-way report about request `id`."""

    id: str


class Open(Report, tag="open"):
    """A request to route: its prompt ids (block hashes come from them), max_tokens
    (the decode KV it reserves), the endpoint (metrics), the client's user and session."""

    prompt: list[int]
    max_tokens: int
    endpoint: str
    user: str | None = None
    session: str | None = None


class Unreachable(Report, tag="unreachable"):
    """`instance` refused the connection: it never got the request."""

    instance: str
    message: str


class Bind(Report, tag="bind"):
    """Decode process `incarnation` of `instance` holds the request until prefill answers."""

    instance: str
    incarnation: str = ""


class Prefilled(Report, tag="prefilled"):
    """`instance` answered with the first token: the prompt's blocks are cached there."""

    instance: str
    usage: PromptUsage


class Broken(Report, tag="broken"):
    """`instance`'s stream (from process `incarnation`, when known) broke mid-request."""

    instance: str
    message: str
    incarnation: str = ""


class End(Report, tag="end"):
    """The run is over: what the client got, and its times in seconds from arrival."""

    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage: PromptUsage | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_gaps_s: list[float] = []


EdgeMessage = Open | Admit | Pick | Ping | Unreachable | Bind | Prefilled | Broken | End
DECODER = msgspec.json.Decoder(EdgeMessage)
_encode = msgspec.json.encode


def frame(obj: object) -> bytes:
    """`obj` as one frame."""
    body = _encode(obj)
    return FRAME_HEADER.pack(len(body)) + body

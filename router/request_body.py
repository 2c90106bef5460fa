"""Reading a generation request's body: media type, size (router/http_limits.py bounds it
before the app), disconnects mid-body, and decoding that cannot crash the handler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from starlette.types import Receive, Scope

from router.client_conn import ClientDisconnected, DisconnectWatch
from router.errors import APIError, InvalidRequest

_T = TypeVar("_T")

_JSON_TYPES = ("application/json",)


class UnsupportedMediaType(APIError):
    """The body is declared as something other than JSON."""

    status = 415
    type = "invalid_request_error"


class Headers:
    """A request's headers as the server gave them (names lower-case); first match wins."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    @property
    def raw(self) -> list[tuple[bytes, bytes]]:
        """(name, value) pairs in the order received (as starlette's Headers.raw)."""
        return self._raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in self._raw:
            if k == key:
                return v.decode("latin-1")
        return default


class GenerationRequest(Protocol):
    """What serving a generation request reads of it, whichever server delivered it:
    RawRequest (ASGI) or router/generation_cycle.py's DirectRequest."""

    @property
    def headers(self) -> Headers: ...

    async def body(self) -> bytes:
        """The whole body; ClientDisconnected if the client leaves before its end."""
        ...

    def disconnect_watch(self) -> DisconnectWatch:
        """The watch that notices the client leaving (one per request)."""
        ...


class RawRequest:
    """What serving a generation request reads of it: headers, body, ASGI `receive`.
    Leaner than starlette's Request (no URL, cookies or form parsing on the hot path)."""

    __slots__ = ("headers", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.headers = Headers(scope["headers"])

    async def body(self) -> bytes:
        """The whole body; ClientDisconnected if the client leaves before its end."""
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] != "http.request":
                raise ClientDisconnected()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def disconnect_watch(self) -> DisconnectWatch:
        """The request's watch: a task awaiting `receive()`'s disconnect message."""
        return DisconnectWatch(self.receive)


async def read_json_body(request: GenerationRequest) -> bytes:
    """The whole body. A Content-Type other than JSON is a 415 (no Content-Type is taken as
    JSON, as curl-less clients send); a client that leaves mid-body is ClientDisconnected,
    not a server error."""
    declared = request.headers.get("content-type")
    if declared is not None:
        media = declared.split(";", 1)[0].strip().lower()
        if media not in _JSON_TYPES and not media.endswith("+json"):
            raise UnsupportedMediaType(
                f"Content-Type {media!r} is not supported: send the body as "
                "application/json (curl: -H 'content-type: application/json')",
                code="unsupported_media_type",
            )
    return await request.body()


def decode_json(decode: Callable[[bytes], _T], body: bytes) -> _T:
    """`decode(body)`, with JSON nested deeper than the decoder can follow as a 400."""
    try:
        return decode(body)
    except RecursionError:
        raise InvalidRequest(
            "the request body's JSON is nested too deeply", code="json_too_deep"
        ) from None

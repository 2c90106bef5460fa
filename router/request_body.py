"""Reading a generation request's body: media type, size (router/http_limits.py bounds it
before the app), disconnects mid-body, and decoding that cannot crash the handler."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from router.client_conn import ClientDisconnected
from router.errors import APIError, InvalidRequest

_T = TypeVar("_T")

_JSON_TYPES = ("application/json",)


class UnsupportedMediaType(APIError):
    """The body is declared as something other than JSON."""

    status = 415
    type = "invalid_request_error"


async def read_json_body(request: Request) -> bytes:
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
    try:
        return await request.body()
    except ClientDisconnect:
        raise ClientDisconnected() from None


def decode_json(decode: Callable[[bytes], _T], body: bytes) -> _T:
    """`decode(body)`, with JSON nested deeper than the decoder can follow as a 400."""
    try:
        return decode(body)
    except RecursionError:
        raise InvalidRequest(
            "the request body's JSON is nested too deeply", code="json_too_deep"
        ) from None

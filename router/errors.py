"""Typed errors of the OpenAI API surface, rendered in OpenAI's JSON error shape.

Every error the router answers with is an `APIError`: its HTTP status, OpenAI `type`,
the offending `param` (when one is to blame) and a machine-readable `code`:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

4xx are the client's fault (the message says what to change); 5xx are ours or a worker's.
"""

from __future__ import annotations

import msgspec


class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    status: int = 500
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


class InvalidRequest(APIError):
    """400: the request is malformed or asks for something invalid."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    """401: missing or wrong API key."""

    status = 401
    type = "invalid_request_error"


class NotFound(APIError):
    """404: unknown model or path."""

    status = 404
    type = "invalid_request_error"


class WorkerError(APIError):
    """An ErrorEvent (or an error answer) from a worker: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, status=status)
        if status < 500:
            self.type = "invalid_request_error"


class WorkerUnavailable(APIError):
    """503: no healthy instance of a role could take the request (nothing was sent yet)."""

    status = 503
    type = "server_error"


class WorkerFailed(APIError):
    """502: a worker dropped the connection, crashed or broke the protocol mid-request."""

    status = 502
    type = "server_error"


class UpstreamTimeout(APIError):
    """504: the request did not finish within request_timeout_s."""

    status = 504
    type = "timeout"

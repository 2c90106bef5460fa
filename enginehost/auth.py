"""The worker side of internal authentication (protocol/internal_auth.py): an ASGI
middleware in front of every route of a worker's app.

A request to any path but OPEN_PATHS must carry `authorization: Bearer <cluster secret>`;
otherwise it is answered 401 with an OpenAI-style error body before any route (or body
read) runs. The comparison is constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from protocol.internal_auth import AUTH_HEADER, OPEN_PATHS, authorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

_HEADER = AUTH_HEADER.encode()
LOG_INTERVAL_S = 60.0
"""Refusals are logged at most this often (a scan must not flood the log)."""
_UNAUTHORIZED = msgspec.json.encode(
    {
        "error": {
            "message": "this is an internal endpoint of a kvserve cluster: send "
            "'authorization: Bearer <cluster secret>' (the launcher gives it to every "
            "component in KVSERVE_CLUSTER_SECRET)",
            "type": "authentication_error",
            "param": None,
            "code": "cluster_secret_required",
        }
    }
)


class InternalAuth:
    """Wraps a worker's ASGI app: HTTP requests without the cluster secret get a 401
    (every path but OPEN_PATHS). Lifespan and other scopes pass through."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret
        self.num_refused = 0
        """Requests answered 401 (for tests and logs)."""
        self._logged_at = -LOG_INTERVAL_S
        self._logged_count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == _HEADER), None)
        if authorized(value, self.secret):
            await self.app(scope, receive, send)
            return
        self.num_refused += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            client = scope.get("client") or ("?", 0)
            log.warning(
                "refused %s %s from %s:%s without the cluster secret (%d refused since the "
                "last warning)",
                scope.get("method"),
                scope["path"],
                client[0],
                client[1],
                self.num_refused - self._logged_count,
            )
            self._logged_at, self._logged_count = now, self.num_refused
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b'Bearer realm="kvserve-internal"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})

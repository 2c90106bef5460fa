"""The cluster secret: how components of one cluster prove to each other that a call is
internal (router -> workers, prefill -> decode, the kvserve CLI -> workers).

    kvserve up ── KVSERVE_CLUSTER_SECRET (environment, never argv) ──▶ router, workers
    every internal HTTP call ── authorization: Bearer <secret> ──▶ worker
    worker: hmac.compare_digest against its own copy, else 401 (OpenAI-style error)

Open without the secret: GET /health (liveness for the supervisor and load balancers)
and GET /metrics (Prometheus): both read-only, neither reveals a request, a prompt or a
cached prefix (docs/reliability.md). Everything else a worker serves needs it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

SECRET_ENV = "KVSERVE_CLUSTER_SECRET"
"""The variable `kvserve up` hands the secret to the router and the workers in (their
child processes, PP stages and TP ranks, inherit it)."""

AUTH_HEADER = "authorization"
MIN_SECRET_CHARS = 32
"""A secret shorter than this is refused (generated ones are 43 characters, 256 bits)."""

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Worker paths answered without the secret."""


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def secret_problem(secret: str) -> str | None:
    """Why `secret` cannot be a cluster secret, or None."""
    if len(secret) < MIN_SECRET_CHARS:
        return f"it has {len(secret)} characters; at least {MIN_SECRET_CHARS} are required"
    if not secret.isprintable() or any(c.isspace() for c in secret):
        return "it contains whitespace or control characters"
    return None


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header an internal call carries (none without a secret)."""
    return {AUTH_HEADER: f"Bearer {secret}"} if secret else {}


def authorized(header_value: bytes | None, secret: str) -> bool:
    """Whether an `authorization` header value proves the secret (constant time)."""
    if header_value is None:
        return False
    return hmac.compare_digest(header_value, f"Bearer {secret}".encode())


def secret_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret `kvserve up` passed in SECRET_ENV; None when absent or empty. Read at a
    process's entry point only, then passed on explicitly."""
    return environ.get(SECRET_ENV) or None

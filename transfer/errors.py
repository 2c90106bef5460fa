"""Typed errors of the handoff path. Messages say what failed and what to do about it."""

from __future__ import annotations

from protocol.errors import KvserveError


class TransferError(KvserveError):
    """A registration or write failed: the peer is down or unreachable, the remote range
    is not inside a buffer the peer registered, or the local range is not registered.

    `code` is the transport's own status (Mooncake's negative integer) when it gave one.
    After a failed write the bytes of the remote range are undefined: the caller must
    treat the whole handoff as failed (abort the request), never retry into a region the
    peer may already have freed.
    """

    def __init__(self, message: str, *, code: int | None = None, peer: str | None = None):
        super().__init__(message)
        self.code = code
        self.peer = peer


class TransportConfigError(KvserveError, ValueError):
    """A transport cannot be created with the given settings (unknown name or protocol,
    a wildcard host, a conflicting MC_TCP_BIND_ADDRESS, Mooncake not installed)."""


class PackLayoutError(KvserveError, ValueError):
    """Tensors, token ranges or a landing layout do not match what gather/scatter/send
    expect (wrong shape or dtype, tokens beyond the block table, segment too large)."""


class LandingError(KvserveError, ValueError):
    """A landing arena was used wrongly: a request id allocated twice, a closed arena, a
    segment outside its region."""

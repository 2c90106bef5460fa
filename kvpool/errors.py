"""Typed errors of the pool and the mapping of Mooncake's integer codes at the boundary.

Mooncake Store reports everything as a plain int (docs MOONCAKE.md §1.8). Per key, a code
becomes a `KeyStatus` (a miss or a failed key is an ordinary outcome, a return value);
a whole call that could not reach the pool raises `PoolUnavailableError`; setup and
registration failures raise the other `PoolError`s, whose messages say what to do.
"""

from __future__ import annotations

import enum

from protocol.errors import KvserveError

CODE_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1012: "NOT_SUPPORTED",
}


def code_name(code: int) -> str:
    return CODE_NAMES.get(code, f"code {code}")


class KeyStatus(enum.Enum):
    """Outcome of one key of a batch call; the value is the metrics `reason` label."""

    OK = "ok"
    MISSING = "missing"
    """Not in the pool (never stored, evicted, removed, or its store died)."""
    LEASED = "leased"
    NO_SPACE = "no_space"
    """Nothing evictable: every candidate is leased or pinned."""
    TRANSFER_FAILED = "transfer_failed"
    """The store holding it did not answer (died: the master drops it after client_ttl)."""
    LEASE_EXPIRED = "lease_expired"
    INVALID = "invalid"
    """Rejected by Mooncake as invalid: on a read, an object of another size than ours."""
    UNAVAILABLE = "unavailable"
    """The master could not be reached."""
    ERROR = "error"


_STATUS_OF: dict[int, KeyStatus] = {
    0: KeyStatus.OK,
    -704: KeyStatus.MISSING,
    -101: KeyStatus.MISSING,
    -706: KeyStatus.LEASED,
    -200: KeyStatus.NO_SPACE,
    -800: KeyStatus.TRANSFER_FAILED,
    -707: KeyStatus.LEASE_EXPIRED,
    -600: KeyStatus.INVALID,
    -10: KeyStatus.INVALID,
    -900: KeyStatus.UNAVAILABLE,
    -901: KeyStatus.UNAVAILABLE,
    -1010: KeyStatus.UNAVAILABLE,
}


def status_of(code: int) -> KeyStatus:
    """The KeyStatus of a Mooncake per-key code (0 or negative)."""
    return _STATUS_OF.get(code, KeyStatus.ERROR)


class PoolError(KvserveError):
    """Base of the pool's errors; `code` is Mooncake's integer when it gave one."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class PoolConfigError(PoolError, ValueError):
    """The pool cannot be used with these settings (unknown backend, buffer too small for
    one chunk, a conflicting MC_TCP_BIND_ADDRESS, Mooncake not installed)."""


class PoolSetupError(PoolError):
    """Connecting to the pool failed (master unreachable, segment could not be mounted)."""


class BufferRegistrationError(PoolError):
    """Registering memory with the pool failed (RDMA: memory that cannot be pinned,
    4 KiB pages where huge pages are needed, MC_MAX_MR_SIZE too small)."""


class PoolUnavailableError(PoolError):
    """A whole call failed: the master did not answer. The caller treats it as a miss
    (or a dropped save) and backs off; nothing was half done on our side."""

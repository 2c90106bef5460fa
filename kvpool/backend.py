"""PoolBackend: raw object operations on a pool, registered by name.

    "mooncake"  Mooncake Store as a pure client (kvpool/mooncake_backend.py)
    "local"     one process's memory, shared by backends with the same `master_address`
                (tests and the conformance suite; kvpool/local_backend.py)
    "none"      the pool is off: nothing exists, writes are discarded

Contract of every backend (tests/test_pool_backends.py runs it against each):
- keys of one batch are distinct; results are per key, in order; a batch may partly
  succeed;
- `put_from` stores `sizes[i]` bytes from `ptrs[i]` under `keys[i]`, in group
  `group_ids[i]` (eviction takes a group whole, best effort); an existing key is left as
  it is and reported OK (the first writer wins: same key, same bytes);
- `get_into` copies an object into [ptrs[i], +sizes[i]) and returns its size, or a
  KeyStatus (MISSING, INVALID when the object does not fit, ...); an object larger than
  the room given is never partly copied;
- `exists` answers per key and may protect what it finds from eviction for a while
  (Mooncake: a read lease, 10 s by default) — call it only right before reading;
- pointers come from a buffer given to `register_buffer`;
- `locate` (optional: the default finds nothing) tells which objects live in this
  process's own mounted segment (`own_segments`), so they can be read in place instead of
  copied; it protects what it finds from eviction until `LocalReplica.lease_until`;
- a call that cannot reach the pool at all raises PoolUnavailableError; `close` is
  idempotent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from kvpool.errors import KeyStatus, PoolConfigError


@dataclass(frozen=True)
class BackendConfig:
    """Where a pool client connects and how it advertises itself."""

    host: str
    """Address of this process (Mooncake advertises it: MC_TCP_BIND_ADDRESS)."""
    master_address: str
    """host:port of the pool's master."""
    protocol: str = "tcp"
    rdma_devices: tuple[str, ...] = ()
    segment_bytes: int = 0
    """Host DRAM this process contributes to the pool as its own segment (a store
    mounted in a prefill process, `pool.stores[].prefill`); 0: a pure client. Objects it
    writes are placed in that segment while it has room, so reading them back is a
    local memcpy instead of a transfer (Mooncake's same-process path)."""
    hugepages: bool = False
    """Back `segment_bytes` with reserved huge pages."""
    master_http: str = ""
    """host:port of the master's HTTP (metrics/admin) server: where this process learns
    the address range of its own segment (in-place reads); "" turns them off."""
    lease_ttl_s: float = 10.0
    """The master's read lease (`pool.master.lease_ttl_s`): how long a `locate` protects
    what it found."""


@dataclass(frozen=True)
class LocalReplica:
    """An object's bytes inside this process's own segment, readable in place."""

    ptr: int
    size: int
    lease_until: float
    """time.monotonic() by which the read must be over: until then the object can be
    neither evicted nor removed without force (the read lease `locate` took)."""


GetResult = int | KeyStatus
"""Bytes read (>= 0), or why nothing was read."""


class PoolBackend(ABC):
    """One connection to a pool; thread-safe (loads, saves and lookups run on different
    threads). See the module docstring for the contract."""

    name: ClassVar[str]
    accepts_writes: ClassVar[bool] = True
    """False for a backend that stores nothing ("none"): callers need not pack data
    for it, and nothing written to it may be announced as saved."""

    @abstractmethod
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, +nbytes) usable by put_from/get_into; BufferRegistrationError."""

    @abstractmethod
    def unregister_buffer(self, ptr: int) -> None: ...

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        group_ids: Sequence[str],
    ) -> list[KeyStatus]: ...

    @abstractmethod
    def get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[GetResult]: ...

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> list[KeyStatus]:
        """Remove now, even if leased (a damaged object must not be read again)."""

    def own_segments(self) -> list[tuple[int, int]]:
        """(base address, bytes) of the memory this process contributes to the pool (its
        mounted segment); [] for a pure client or a backend that cannot tell."""
        return []

    def locate(self, keys: Sequence[str]) -> list[LocalReplica | None]:
        """Per key: its replica inside `own_segments`, leased for reading, or None (not
        there: missing, elsewhere, or unknown; read it with get_into)."""
        return [None] * len(keys)

    @abstractmethod
    def close(self) -> None: ...


_B = TypeVar("_B", bound=type[PoolBackend])
_BACKENDS: dict[str, Callable[[BackendConfig], PoolBackend]] = {}


def register_backend(cls: _B) -> _B:
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def create_backend(name: str, config: BackendConfig) -> PoolBackend:
    """A connected backend by name; PoolConfigError lists the known names."""
    import kvpool.local_backend
    import kvpool.mooncake_backend  # noqa: F401 (registers)

    factory = _BACKENDS.get(name)
    if factory is None:
        raise PoolConfigError(f"unknown pool backend {name!r}; known: {', '.join(backend_names())}")
    return factory(config)


@register_backend
class NoneBackend(PoolBackend):
    """The pool is off (`pool.enabled: false`): nothing exists, writes are discarded."""

    name = "none"
    accepts_writes = False

    def __init__(self, config: BackendConfig | None = None) -> None:
        del config

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        return None

    def unregister_buffer(self, ptr: int) -> None:
        return None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    def put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        group_ids: Sequence[str],
    ) -> list[KeyStatus]:
        return [KeyStatus.OK] * len(keys)

    def get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[GetResult]:
        return [KeyStatus.MISSING] * len(keys)

    def remove(self, keys: Sequence[str]) -> list[KeyStatus]:
        return [KeyStatus.MISSING] * len(keys)

    def close(self) -> None:
        return None

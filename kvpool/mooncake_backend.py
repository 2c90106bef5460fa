"""The "mooncake" pool backend: one MooncakeDistributedStore client.

By default a prefill device only uses the pool, it contributes no memory
(global_segment_size=0, local_buffer_size=0; the Store services own the DRAM). With
`segment_bytes` > 0 the client also mounts a segment of that size (a store mounted in
the prefill process): its puts name that segment as `preferred_segment`, so its own
objects land there while it has room (then anywhere, Mooncake's fallback), and Mooncake
serves reads of them by a memcpy in this process (MC_STORE_MEMCPY, set on here) instead
of a transfer through a store process; other clients read the segment over the
transport as from any store. With local_buffer_size=0 only the zero-copy calls work,
which is all we use: batch_is_exist, batch_put_from (with ReplicateConfig.group_ids),
batch_get_into, batch_remove. Metadata goes over P2PHANDSHAKE (no metadata server).
Mooncake advertises MC_TCP_BIND_ADDRESS, so it is set here from the configured host;
another value already set in this process is an error.

Measured behaviour this relies on (docs MOONCAKE.md): a missing master makes every call
return -900 after ~4 s (the first one sooner); a dead store makes reads of its objects
return -800 after ~1 s until the master drops its segment (client_ttl); after a master
restart the same client works again (the Store services remount by themselves).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from kvpool.backend import BackendConfig, GetResult, PoolBackend, register_backend
from kvpool.errors import (
    BufferRegistrationError,
    KeyStatus,
    PoolConfigError,
    PoolSetupError,
    PoolUnavailableError,
    code_name,
    status_of,
)

METADATA_SERVER = "P2PHANDSHAKE"
MAX_EXIST_KEYS = 8192
"""Keys per batch_is_exist call (ATOM's slice size)."""


def set_bind_address(host: str) -> None:
    """Make Mooncake advertise `host` in this process (MC_TCP_BIND_ADDRESS)."""
    current = os.environ.get("MC_TCP_BIND_ADDRESS")
    if current is not None and current != host:
        raise PoolConfigError(
            f"MC_TCP_BIND_ADDRESS is {current!r} in this process but the pool client's host "
            f"is {host!r}: Mooncake has one advertised address per process; make them agree"
        )
    os.environ["MC_TCP_BIND_ADDRESS"] = host


def import_store() -> Any:
    """mooncake.store, or a PoolConfigError that says how to install it."""
    try:
        import mooncake.store as store
    except ImportError as e:
        raise PoolConfigError(
            f"the pool needs Mooncake Store ({e}): install kvserve[cpu] (or [cuda]/[rocm]) "
            "and the system libraries libibverbs1 librdmacm1 (scripts/setup.sh does both)"
        ) from e
    return store


def _unavailable_if_all(codes: Sequence[int], what: str) -> None:
    if codes and all(status_of(c) is KeyStatus.UNAVAILABLE for c in codes):
        raise PoolUnavailableError(
            f"Mooncake {what} failed: {code_name(codes[0])} (the pool master is not answering)",
            code=codes[0],
        )


@register_backend
class MooncakeBackend(PoolBackend):
    """Owns one MooncakeDistributedStore client (pure client) and its registrations."""

    name = "mooncake"

    def __init__(self, config: BackendConfig) -> None:
        set_bind_address(config.host)
        if config.protocol == "rdma":
            # Without this Mooncake silently falls back to TCP when it finds no HCA.
            os.environ.setdefault("MC_FORCE_HCA", "1")
        if config.segment_bytes:
            # Same-process reads and writes as a memcpy: Mooncake turns it on by itself
            # only in TCP-only builds; over RDMA a loopback transfer would be slower.
            os.environ.setdefault("MC_STORE_MEMCPY", "1")
            if config.hugepages:
                os.environ["MC_STORE_USE_HUGEPAGE"] = "1"
                os.environ.setdefault("MC_STORE_HUGEPAGE_SIZE", "2MB")
        store = import_store()
        self._store_mod = store
        self._store: Any = store.MooncakeDistributedStore()
        rc = self._store.setup(
            config.host,
            METADATA_SERVER,
            config.segment_bytes,
            0,
            config.protocol,
            ",".join(config.rdma_devices),
            config.master_address,
        )
        if rc != 0:
            mount = (
                f" and mounting a {config.segment_bytes}-byte segment (is that much memory "
                "free here?)"
                if config.segment_bytes
                else ""
            )
            raise PoolSetupError(
                f"connecting to the pool master at {config.master_address}{mount} failed "
                f"({code_name(rc)}): is the master running (kvserve status) and reachable "
                f"from {config.host}?",
                code=rc,
            )
        self._closed = False
        self._lock = threading.Lock()
        self.config = config
        self.address = self._store.get_hostname()
        self.segment: str | None = self.address if config.segment_bytes else None
        """This process's own segment name, where its puts go first; None: pure client."""

    def _live(self) -> Any:
        """The store client; a closed one must never be called (Mooncake would crash)."""
        if self._closed:
            raise PoolUnavailableError("this pool client is closed")
        return self._store

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        rc = self._live().register_buffer(ptr, nbytes)
        if rc != 0:
            raise BufferRegistrationError(
                f"registering {nbytes} bytes at {ptr:#x} with the pool failed "
                f"({code_name(rc)}): for RDMA the buffer must be pinnable (huge pages for "
                "large buffers, MC_MAX_MR_SIZE >= its size) and must not overlap another "
                "registration",
                code=rc,
            )

    def unregister_buffer(self, ptr: int) -> None:
        if not self._closed:
            self._store.unregister_buffer(ptr)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for i in range(0, len(keys), MAX_EXIST_KEYS):
            codes = list(self._live().batch_is_exist(list(keys[i : i + MAX_EXIST_KEYS])))
            bad = [c for c in codes if c < 0]
            if bad:
                raise PoolUnavailableError(
                    f"Mooncake batch_is_exist failed: {code_name(bad[0])}", code=bad[0]
                )
            out.extend(c == 1 for c in codes)
        return out

    def put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        group_ids: Sequence[str],
    ) -> list[KeyStatus]:
        config = self._store_mod.ReplicateConfig()
        config.group_ids = list(group_ids)
        if self.segment is not None:
            config.preferred_segment = self.segment
        codes = list(self._live().batch_put_from(list(keys), list(ptrs), list(sizes), config))
        _unavailable_if_all(codes, "batch_put_from")
        return [status_of(c) for c in codes]

    def get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[GetResult]:
        codes = list(self._live().batch_get_into(list(keys), list(ptrs), list(sizes)))
        _unavailable_if_all(codes, "batch_get_into")
        return [c if c >= 0 else status_of(c) for c in codes]

    def remove(self, keys: Sequence[str]) -> list[KeyStatus]:
        codes = list(self._live().batch_remove(list(keys), True))
        _unavailable_if_all(codes, "batch_remove")
        return [status_of(c) for c in codes]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.close()

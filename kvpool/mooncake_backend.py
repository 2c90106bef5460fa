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

In-place reads (`locate`): `batch_get_replica_desc` answers where each object's replica
is (buffer address, size, transfer endpoint) and grants the same read lease as a get. A
replica whose endpoint is this client's and whose bytes lie inside this process's own
segment (its range comes from the master's /get_segments_detail, once) is readable at
that address in this process; the caller reads it there instead of having Mooncake copy
it into a load slot (docs/pool.md, "Reading in place").

Measured behaviour this relies on (docs MOONCAKE.md): a missing master makes every call
return -900 after ~4 s (the first one sooner); a dead store makes reads of its objects
return -800 after ~1 s until the master drops its segment (client_ttl); after a master
restart the same client works again (the Store services remount by themselves).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvpool.backend import (
    BackendConfig,
    GetResult,
    LocalReplica,
    PoolBackend,
    register_backend,
)
from kvpool.errors import (
    BufferRegistrationError,
    KeyStatus,
    PoolConfigError,
    PoolSetupError,
    PoolUnavailableError,
    code_name,
    status_of,
)

log = logging.getLogger(__name__)

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
        self._own: tuple[str, list[tuple[int, int]]] | None = None
        """(transfer endpoint, [(base, bytes)]) of the own segment, once learned."""

    def own_segments(self) -> list[tuple[int, int]]:
        return self._own_segment()[1]

    def _own_segment(self) -> tuple[str, list[tuple[int, int]]]:
        """This process's segment as the master describes it (asked once): its transfer
        endpoint (what replica descriptors name) and its address ranges (several when a
        transport splits a large segment). ("", []) for a pure client, or when the master
        cannot say: every read then goes through get_into."""
        if self._own is not None:
            return self._own
        own: tuple[str, list[tuple[int, int]]] = ("", [])
        if self.segment is not None and self.config.master_http:
            url = f"http://{self.config.master_http}/get_segments_detail"
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    detail = json.loads(resp.read())
                mine = [s for s in detail["segments"] if s["segment_name"] == self.segment]
                endpoints = {s["te_endpoint"] for s in mine}
                if len(endpoints) == 1 and all(s["status"] == "OK" for s in mine):
                    ranges = [(int(s["base_address"], 16), int(s["size_bytes"])) for s in mine]
                    own = (endpoints.pop(), ranges)
                else:
                    log.warning(
                        "the master lists segment %s as %s: no in-place reads", self.segment, mine
                    )
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("no in-place pool reads: %s did not describe this segment (%s)", url, e)
        self._own = own
        return own

    def locate(self, keys: Sequence[str]) -> list[LocalReplica | None]:
        endpoint, ranges = self._own_segment()
        if not ranges or not keys:
            return [None] * len(keys)
        # Mooncake dates the lease from before its request (Client::Query): so do we.
        lease_until = time.monotonic() + self.config.lease_ttl_s
        try:
            found = self._live().batch_get_replica_desc(list(keys))
        except PoolUnavailableError:
            raise
        except Exception as e:  # a failed query only means: read through get_into
            log.warning("batch_get_replica_desc failed (%s): reading through get_into", e)
            return [None] * len(keys)
        complete = self._store_mod.ReplicaStatus.COMPLETE
        out: list[LocalReplica | None] = []
        for key in keys:
            hit = None
            for rep in found.get(key, ()):
                if not rep.is_memory_replica() or rep.status != complete:
                    continue
                desc = rep.get_memory_descriptor().buffer_descriptor
                ptr, size = int(desc.buffer_address), int(desc.size)
                # Mooncake's own same-process rule (its local memcpy) is the endpoint; the
                # range check makes sure the bytes are mapped here whatever it says.
                if desc.transport_endpoint == endpoint and any(
                    b <= ptr and ptr + size <= b + n for b, n in ranges
                ):
                    hit = LocalReplica(ptr, size, lease_until)
                    break
            out.append(hit)
        return out

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

"""The "local" pool backend: objects in this process's memory, for tests and the
conformance suite. Backends created with the same `master_address` share one pool, as
two clients of one Mooncake master would.

It keeps Mooncake's visible semantics: put never overwrites, reads need room for the
whole object, and when a put does not fit, whole groups are evicted in LRU order (least
recently written or read first). Capacity comes from `master_address`'s query string:
"local-a?capacity=1048576" (default 1 GiB). There are no leases.

A client with `segment_bytes` > 0 also mounts its own segment, as a Mooncake client does:
one page-aligned mapping where its puts go while it has room (bump allocation: evicted
or removed objects leave their bytes there, unread, until the client closes), which
`own_segments` / `locate` report, so in-place reads can be tested without Mooncake
(CUDA tests among them). Its objects leave the pool when it closes.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from kvpool.backend import (
    BackendConfig,
    GetResult,
    LocalReplica,
    PoolBackend,
    register_backend,
)
from kvpool.errors import BufferRegistrationError, KeyStatus, PoolConfigError


@dataclass
class _Pool:
    """One shared in-memory pool: objects, their groups, and LRU order of groups."""

    capacity_bytes: int
    objects: dict[str, tuple[bytes | ctypes.Array[ctypes.c_uint8], str]] = field(
        default_factory=dict
    )
    """key -> (its bytes: a copy, or an array in a client's segment, group id)."""
    groups: OrderedDict[str, set[str]] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def touch(self, key: str) -> None:
        group = self.objects[key][1] or key
        self.groups.move_to_end(group)

    def evict_for(self, nbytes: int) -> bool:
        while self.used_bytes + nbytes > self.capacity_bytes and self.groups:
            _, members = self.groups.popitem(last=False)
            for k in members:
                data, _ = self.objects.pop(k)
                self.used_bytes -= len(data)
        return self.used_bytes + nbytes <= self.capacity_bytes

    def drop(self, key: str) -> None:
        data, group = self.objects.pop(key)
        self.used_bytes -= len(data)
        members = self.groups[group or key]
        members.discard(key)
        if not members:
            del self.groups[group or key]


_POOLS: dict[str, _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _pool_for(address: str) -> _Pool:
    parts = urlsplit("//" + address)
    query = parse_qs(parts.query)
    try:
        capacity = int(query.get("capacity", [str(1 << 30)])[0])
    except ValueError:
        raise PoolConfigError(f"bad capacity in local pool address {address!r}") from None
    name = address.split("?")[0]
    with _POOLS_LOCK:
        return _POOLS.setdefault(name, _Pool(capacity))


@register_backend
class LocalBackend(PoolBackend):
    """A client of an in-process pool; see the module docstring."""

    name = "local"

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._pool = _pool_for(config.master_address)
        self._buffers: dict[int, int] = {}
        self._segment = mmap.mmap(-1, config.segment_bytes) if config.segment_bytes else None
        self._segment_used = 0
        self._segment_base = (
            ctypes.addressof(ctypes.c_uint8.from_buffer(self._segment)) if self._segment else 0
        )

    def _store(self, ptr: int, size: int) -> bytes | ctypes.Array[ctypes.c_uint8]:
        """The object's bytes, in the own segment while it has room, else a copy."""
        seg = self._segment
        if seg is not None and self._segment_used + size <= len(seg):
            arr = (ctypes.c_uint8 * size).from_buffer(seg, self._segment_used)
            self._segment_used += -(-size // 64) * 64
            ctypes.memmove(arr, ptr, size)
            return arr
        return ctypes.string_at(ptr, size)

    def own_segments(self) -> list[tuple[int, int]]:
        return [(self._segment_base, len(self._segment))] if self._segment else []

    def locate(self, keys: Sequence[str]) -> list[LocalReplica | None]:
        seg = self._segment
        if seg is None:
            return [None] * len(keys)
        until = time.monotonic() + self.config.lease_ttl_s
        out: list[LocalReplica | None] = []
        with self._pool.lock:
            for key in keys:
                item = self._pool.objects.get(key)
                data = None if item is None else item[0]
                if isinstance(data, ctypes.Array) and _inside(data, self._segment_base, len(seg)):
                    self._pool.touch(key)
                    out.append(LocalReplica(ctypes.addressof(data), len(data), until))
                else:
                    out.append(None)
        return out

    def _check(self, ptr: int, nbytes: int) -> None:
        if not any(b <= ptr and ptr + nbytes <= b + n for b, n in self._buffers.items()):
            raise BufferRegistrationError(f"[{ptr:#x}, +{nbytes}) is not in a registered buffer")

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self._buffers[ptr] = nbytes

    def unregister_buffer(self, ptr: int) -> None:
        self._buffers.pop(ptr, None)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._pool.lock:
            return [k in self._pool.objects for k in keys]

    def put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        group_ids: Sequence[str],
    ) -> list[KeyStatus]:
        if not len(keys) == len(ptrs) == len(sizes) == len(group_ids):
            return [KeyStatus.INVALID] * len(keys)
        out = []
        pool = self._pool
        for key, ptr, size, group in zip(keys, ptrs, sizes, group_ids, strict=True):
            self._check(ptr, size)
            with pool.lock:
                if key in pool.objects:
                    out.append(KeyStatus.OK)
                    continue
                if not pool.evict_for(size):
                    out.append(KeyStatus.NO_SPACE)
                    continue
                pool.objects[key] = (self._store(ptr, size), group)
                pool.groups.setdefault(group or key, set()).add(key)
                pool.touch(key)
                pool.used_bytes += size
            out.append(KeyStatus.OK)
        return out

    def get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[GetResult]:
        out: list[GetResult] = []
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self._check(ptr, size)
            with self._pool.lock:
                item = self._pool.objects.get(key)
                if item is not None:
                    self._pool.touch(key)
            if item is None:
                out.append(KeyStatus.MISSING)
            elif len(item[0]) > size:
                out.append(KeyStatus.INVALID)
            else:
                ctypes.memmove(ptr, item[0], len(item[0]))
                out.append(len(item[0]))
        return out

    def remove(self, keys: Sequence[str]) -> list[KeyStatus]:
        out = []
        with self._pool.lock:
            for k in keys:
                if k in self._pool.objects:
                    self._pool.drop(k)
                    out.append(KeyStatus.OK)
                else:
                    out.append(KeyStatus.MISSING)
        return out

    def close(self) -> None:
        self._buffers.clear()
        seg = self._segment
        if seg is not None:  # its objects die with it, as with a Mooncake segment
            with self._pool.lock:
                for key, (data, _) in list(self._pool.objects.items()):
                    if isinstance(data, ctypes.Array) and _inside(
                        data, self._segment_base, len(seg)
                    ):
                        self._pool.drop(key)


def _inside(data: ctypes.Array[ctypes.c_uint8], base: int, nbytes: int) -> bool:
    ptr = ctypes.addressof(data)
    return base <= ptr and ptr + len(data) <= base + nbytes


def reset_local_pools() -> None:
    """Forget every in-process pool (tests)."""
    with _POOLS_LOCK:
        _POOLS.clear()

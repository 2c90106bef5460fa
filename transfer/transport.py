"""The Transport interface: one-sided writes from a local registered buffer into a peer's
registered buffer, registered by name ("mooncake", "cuda_ipc", "local").

A write of `nbytes` is split into ops of at most MAX_OP_BYTES, submitted as one batch:

    local_ptr                                                  local_ptr + nbytes
    |<------ 8 MiB ------>|<------ 8 MiB ------>|<-- rest -->|
    op 0                  op 1                  op 2            num_ops = ceil(nbytes / 8 MiB)
    remote_addr           remote_addr + 8 MiB   remote_addr + 16 MiB

Which side runs what: the receiving side (decode) registers its landing buffer and
publishes `peer_address` plus buffer addresses (in LandingInfo); the sending side
(prefill) registers its staging buffer and calls `write`. Both sides register: with
Mooncake over RDMA an unregistered range on either end cannot move.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from protocol.incarnation import new_incarnation
from transfer.errors import TransferError, TransportConfigError

MAX_OP_BYTES = 8 << 20
"""Largest single op (DESIGN §5 step 5): big enough to run at line rate, small enough to
pipeline and to keep one failure cheap."""

PROTOCOLS = ("tcp", "rdma")


class WriteOp(NamedTuple):
    """One contiguous op: `nbytes` from local `local_ptr` to the peer's `remote_addr`."""

    local_ptr: int
    remote_addr: int
    nbytes: int


@dataclass(frozen=True)
class WriteStats:
    """What one or more writes moved, for metrics and FlowClosed."""

    num_bytes: int = 0
    num_ops: int = 0
    seconds: float = 0.0

    def __add__(self, other: WriteStats) -> WriteStats:
        return WriteStats(
            self.num_bytes + other.num_bytes,
            self.num_ops + other.num_ops,
            self.seconds + other.seconds,
        )

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one process's transport (the same definition the cluster config reads)."""

    name: str = "mooncake"
    """Registered transport: "mooncake" (between processes and hosts), "cuda_ipc" (GPU to
    GPU between processes of one host) or "local" (one process)."""
    host: str = "127.0.0.1"
    """Address this process advertises and binds; the cluster interface, never 0.0.0.0.
    Mooncake's MC_TCP_BIND_ADDRESS is set from it."""
    protocol: str = "tcp"
    """Mooncake protocol: "tcp", or "rdma" (then missing HCAs are an error, not TCP)."""
    device_name: str = ""
    """RDMA devices for Mooncake, comma-separated; "" lets Mooncake discover them."""
    write_timeout_s: int = 30
    """A write to a stalled peer fails after this (plus 1 s per GiB moved); Mooncake's
    minimum is 5."""

    def __post_init__(self) -> None:
        if self.name not in _REGISTRY:
            raise TransportConfigError(
                f"transport.name: unknown transport {self.name!r}; valid: {transport_names()}"
            )
        if self.protocol not in PROTOCOLS:
            raise TransportConfigError(
                f"transport.protocol: {self.protocol!r} is not one of {list(PROTOCOLS)}"
            )
        if self.write_timeout_s < 5:
            raise TransportConfigError(
                f"transport.write_timeout_s: {self.write_timeout_s} is below Mooncake's minimum of 5"
            )
        if self.host in ("", "0.0.0.0", "::", "[::]"):
            raise TransportConfigError(
                f"transport.host: {self.host!r} is a wildcard; give the cluster interface's "
                "address (127.0.0.1 on one host)"
            )


def split_ops(local_ptr: int, remote_addr: int, nbytes: int) -> list[WriteOp]:
    """Split one contiguous write into ops of at most MAX_OP_BYTES (diagram above)."""
    return [
        WriteOp(local_ptr + off, remote_addr + off, min(MAX_OP_BYTES, nbytes - off))
        for off in range(0, nbytes, MAX_OP_BYTES)
    ]


class Transport(abc.ABC):
    """Moves bytes one-sidedly into a peer's registered memory.

    Owns the set of local buffers registered with it (ranges, never overlapping).
    Contract:
    - `register_buffer` makes [ptr, ptr + nbytes) usable as a write source and as a
      write target for peers; the memory must outlive the registration. Fails with
      TransferError (overlap, or the backend refused it).
    - `write` reads local memory and mutates the peer's memory only; it returns when
      every op has landed, or raises TransferError (never returns partial success
      silently). A failed write leaves the remote range undefined. A stalled peer
      fails the write after config.write_timeout_s + 1 s per GiB.
    - `close` unregisters everything; the transport is unusable afterwards.
    Methods are not thread-safe unless an implementation says so.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._regions: dict[int, int] = {}  # ptr -> nbytes
        self.incarnation = new_incarnation()
        """This transport's run (protocol/incarnation.py): landings name it beside
        `peer_address`, so a writer can tell a restarted peer from the one it knew."""

    @property
    @abc.abstractmethod
    def peer_address(self) -> str:
        """What the other side passes as `peer` to write into this transport's buffers."""

    def note_peer(self, peer: str, incarnation: str) -> None:  # noqa: B027 (optional hook)
        """The next writes to `peer` are for its `incarnation` ("" = unknown): forget
        whatever was cached about an earlier process under that name. Call it from the
        thread that writes. The default caches nothing."""

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        if ptr <= 0 or nbytes <= 0:
            raise TransferError(f"cannot register ptr={ptr:#x} nbytes={nbytes}: both must be > 0")
        for p, n in self._regions.items():
            if ptr < p + n and p < ptr + nbytes:
                raise TransferError(
                    f"buffer [{ptr:#x}, +{nbytes}) overlaps registered [{p:#x}, +{n}): "
                    "register each buffer once, as a whole"
                )
        self._register(ptr, nbytes)
        self._regions[ptr] = nbytes

    def register_tensor(self, tensor: Any) -> None:
        """Register a contiguous tensor's bytes (landing arenas and staging buffers do
        this). The default registers its range; a transport that must hold the allocation
        itself (cuda_ipc exports it to peers) overrides it."""
        self.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def unregister_buffer(self, ptr: int) -> None:
        if self._regions.pop(ptr, None) is None:
            raise TransferError(f"buffer {ptr:#x} is not registered with {self.name}")
        self._unregister(ptr)

    def is_registered(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies inside one registered buffer."""
        return any(p <= ptr and ptr + nbytes <= p + n for p, n in self._regions.items())

    def write(self, peer: str, local_ptr: int, remote_addr: int, nbytes: int) -> WriteStats:
        """Copy [local_ptr, +nbytes) to the peer's [remote_addr, +nbytes) in ops of at
        most MAX_OP_BYTES, one batch. Raises TransferError on any failure."""
        if nbytes < 0:
            raise TransferError(f"write of {nbytes} bytes: the size must be >= 0")
        return self.write_ops(peer, split_ops(local_ptr, remote_addr, nbytes))

    def write_ops(self, peer: str, ops: Sequence[WriteOp]) -> WriteStats:
        """Submit `ops` (each at most MAX_OP_BYTES) as one batch. The handoff path uses
        `write`; scattered ops exist for reference baselines and future layouts."""
        for op in ops:
            if not 0 < op.nbytes <= MAX_OP_BYTES:
                raise TransferError(f"op of {op.nbytes} bytes: must be in (0, {MAX_OP_BYTES}]")
            if not self.is_registered(op.local_ptr, op.nbytes):
                raise TransferError(
                    f"local range [{op.local_ptr:#x}, +{op.nbytes}) is not inside a buffer "
                    f"registered with this {self.name} transport: register the staging "
                    "buffer first"
                )
        start = time.perf_counter()
        if ops:
            self._write_batch(peer, ops)
        seconds = time.perf_counter() - start
        return WriteStats(sum(op.nbytes for op in ops), len(ops), seconds)

    def close(self) -> None:
        for ptr in list(self._regions):
            self.unregister_buffer(ptr)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _register(self, ptr: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _unregister(self, ptr: int) -> None: ...

    @abc.abstractmethod
    def _write_batch(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """Move every op or raise TransferError; ops are validated locally already."""


HANDOFF_PROTOCOLS = ("tcp", "rdma", "cuda_ipc")
"""Values of cluster.yaml's transfer.protocol."""


def handoff_transport_config(protocol: str, host: str) -> TransportConfig:
    """The transport a handoff over cluster.yaml's `transfer.protocol` uses: "cuda_ipc"
    (instances on GPUs of one host, GPU to GPU) or Mooncake over "tcp" / "rdma"."""
    if protocol == "cuda_ipc":
        return TransportConfig(name="cuda_ipc", host=host)
    return TransportConfig(name="mooncake", host=host, protocol=protocol)


def expected_num_ops(nbytes: int) -> int:
    """Ops of one `write` of nbytes: ceil(nbytes / MAX_OP_BYTES)."""
    return math.ceil(nbytes / MAX_OP_BYTES)


_REGISTRY: dict[str, Callable[..., Transport]] = {}


def register_transport(name: str) -> Callable[[type[Transport]], type[Transport]]:
    """Class decorator: make a Transport creatable by `name` from a TransportConfig."""

    def deco(cls: type[Transport]) -> type[Transport]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def transport_names() -> list[str]:
    return sorted(_REGISTRY)


def create_transport(config: TransportConfig, **deps: Any) -> Transport:
    """The transport named by config.name. `deps` are implementation-specific live
    objects (the "local" transport takes `fabric=`)."""
    return _REGISTRY[config.name](config, **deps)

"""The "local" transport: peers in one process, writes are memmove.

For single-process serving (prefill and decode in one process) and as the reference
implementation in the transport conformance suite. Peers find each other through a
LocalFabric passed explicitly to every transport that should reach the others; a
transport made without one gets a private fabric and can only write to itself (which is
enough when one transport owns both the staging and the landing buffer).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from transfer.errors import TransferError
from transfer.transport import Transport, TransportConfig, WriteOp, register_transport


class LocalFabric:
    """The address book of LocalTransports that can write into each other's buffers.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, LocalTransport] = {}
        self._ids = itertools.count()

    def attach(self, transport: LocalTransport) -> str:
        with self._lock:
            address = f"local:{next(self._ids)}"
            self._peers[address] = transport
            return address

    def detach(self, address: str) -> None:
        with self._lock:
            self._peers.pop(address, None)

    def lookup(self, address: str) -> LocalTransport | None:
        with self._lock:
            return self._peers.get(address)


@register_transport("local")
class LocalTransport(Transport):
    """Owns its registered ranges and its fabric address; writes are checked against the
    peer's registered ranges exactly as a remote peer would check them, then memmoved."""

    def __init__(self, config: TransportConfig | None = None, *, fabric: LocalFabric | None = None):
        super().__init__()
        self._fabric = fabric if fabric is not None else LocalFabric()
        self._address = self._fabric.attach(self)

    @property
    def peer_address(self) -> str:
        return self._address

    def _register(self, ptr: int, nbytes: int) -> None:
        pass

    def _unregister(self, ptr: int) -> None:
        pass

    def _write_batch(self, peer: str, ops: Sequence[WriteOp]) -> None:
        target = self._fabric.lookup(peer)
        if target is None:
            raise TransferError(
                f"local peer {peer!r} is not on this fabric (closed, or made with another "
                "LocalFabric)",
                peer=peer,
            )
        for op in ops:
            if not target.is_registered(op.remote_addr, op.nbytes):
                raise TransferError(
                    f"remote range [{op.remote_addr:#x}, +{op.nbytes}) is not inside a buffer "
                    f"that {peer} registered",
                    peer=peer,
                )
        for op in ops:
            ctypes.memmove(op.remote_addr, op.local_ptr, op.nbytes)

    def close(self) -> None:
        super().close()
        self._fabric.detach(self._address)

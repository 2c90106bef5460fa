"""The "mooncake" transport: Mooncake Transfer Engine, P2P handshake, tcp or rdma.

Addressing (docs MOONCAKE.md §3, §4.1): with P2PHANDSHAKE there is no metadata server;
a peer is named "host:rpc_port", where rpc_port is picked by Mooncake at initialize.
Mooncake advertises MC_TCP_BIND_ADDRESS (else the host's first LAN address), so it is set
here from the configured host; a different value already in the environment (another
component of this process chose another interface) is a configuration error. The TE's
listening sockets still bind all interfaces (a Mooncake limitation we cannot narrow).

A peer's name is not unique over time: a restarted decode rank may draw the port its dead
predecessor had, and the engine's segment cache (one entry per name, filled by the first
write's handshake, never refreshed, not reachable from Python in 0.3.13) then still
points at the dead process's TCP data port: every write fails until this process
restarts (reproduced with two processes forced onto a small MC_MIN/MAX_RPC_PORT range).
Landings carry the peer transport's incarnation (protocol/incarnation.py); `note_peer`
rebuilds the engine, with every registered buffer, when a known name comes back with a
new one. That costs an initialize and re-registration, once per such restart.

Mooncake reports failures as integers: initialize/register_memory/batch writes return 0
or a negative code (-1 for a refused or failed write); they become TransferError here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from transfer.errors import TransferError, TransportConfigError
from transfer.transport import Transport, TransportConfig, WriteOp, register_transport

log = logging.getLogger(__name__)

MAX_BATCH_OPS = 1024
"""Entries per Mooncake batch (8 GiB of 8 MiB ops). Over tcp, 0.3.13.post1 queues about
2048 transfers per peer and fails a whole larger batch with -1 ("TCP lane queue-full
rejection" in the log): a batch of 4096 small ops failed, 2048 passed."""


def _set_bind_address(host: str) -> None:
    current = os.environ.get("MC_TCP_BIND_ADDRESS")
    if current is not None and current != host:
        raise TransportConfigError(
            f"MC_TCP_BIND_ADDRESS is {current!r} in this process but the transport host is "
            f"{host!r}: Mooncake has one advertised address per process; make them agree"
        )
    os.environ["MC_TCP_BIND_ADDRESS"] = host


@register_transport("mooncake")
class MooncakeTransport(Transport):
    """Owns one mooncake.engine.TransferEngine and the memory registered with it.
    Writes are `batch_transfer_sync_write` (the GIL is released while they run)."""

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        _set_bind_address(config.host)
        if config.protocol == "rdma":
            # Without this Mooncake silently falls back to TCP when it finds no HCA.
            os.environ.setdefault("MC_FORCE_HCA", "1")
        self._config = config
        self._peer_incarnations: dict[str, str] = {}
        self._engine: Any = self._new_engine()
        self._address = f"{config.host}:{self._engine.get_rpc_port()}"

    def _new_engine(self) -> Any:
        config = self._config
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransportConfigError(
                f"the mooncake transport needs the Mooncake Transfer Engine ({e}): install "
                "kvserve[cpu] (or [cuda]/[rocm]) and the system libraries libibverbs1 "
                "librdmacm1 (scripts/setup.sh does both)"
            ) from e
        # Read once, by the engine's constructor: set it for this engine only.
        saved = os.environ.get("MC_TRANSFER_TIMEOUT")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(config.write_timeout_s)
        try:
            engine = TransferEngine()
        finally:
            if saved is None:
                del os.environ["MC_TRANSFER_TIMEOUT"]
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = saved
        rc = engine.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({config.host!r}, P2PHANDSHAKE, "
                f"{config.protocol!r}, {config.device_name!r}) failed with {rc}: check the "
                "host is an address of this machine and, for rdma, that the devices exist",
                code=rc,
            )
        return engine

    def note_peer(self, peer: str, incarnation: str) -> None:
        """A peer name Mooncake reuses for a new process (module docstring) gets a fresh
        engine: the old one would keep writing to the dead process's data port. This
        transport's own `peer_address` changes with it (a writer's address is not used
        by anyone)."""
        if not incarnation or self._engine is None:
            return
        known = self._peer_incarnations.setdefault(peer, incarnation)
        if known == incarnation:
            return
        log.warning(
            "Mooncake peer %s is a new process (incarnation %s, was %s): rebuilding this "
            "Transfer Engine, whose cached segment of that name is the old process's",
            peer,
            incarnation,
            known,
        )
        engine = self._new_engine()
        for ptr, nbytes in self._regions.items():
            rc = engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(
                    f"Mooncake register_memory({ptr:#x}, {nbytes}) on the rebuilt engine "
                    f"failed with {rc}",
                    code=rc,
                    peer=peer,
                )
        for ptr in self._regions:
            self._engine.unregister_memory(ptr)
        self._engine = engine
        self._address = f"{self._config.host}:{engine.get_rpc_port()}"
        # The old engine's other peers are reopened lazily by the new one.
        self._peer_incarnations = {peer: incarnation}

    @property
    def peer_address(self) -> str:
        return self._address

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(
                f"Mooncake register_memory({ptr:#x}, {nbytes}) failed with {rc}: for RDMA "
                "the memory must be pinnable (huge pages for large buffers, MC_MAX_MR_SIZE) "
                "and must not overlap another registration",
                code=rc,
            )

    def _unregister(self, ptr: int) -> None:
        rc = self._engine.unregister_memory(ptr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory({ptr:#x}) failed with {rc}", code=rc)

    def _write_batch(self, peer: str, ops: Sequence[WriteOp]) -> None:
        if self._engine is None:
            raise TransferError("this mooncake transport is closed", peer=peer)
        for i in range(0, len(ops), MAX_BATCH_OPS):
            batch = ops[i : i + MAX_BATCH_OPS]
            rc = self._engine.batch_transfer_sync_write(
                peer,
                [op.local_ptr for op in batch],
                [op.remote_addr for op in batch],
                [op.nbytes for op in batch],
            )
            if rc != 0:
                lo = min(op.remote_addr for op in batch)
                hi = max(op.remote_addr + op.nbytes for op in batch)
                raise TransferError(
                    f"Mooncake write of {len(batch)} ops ({sum(op.nbytes for op in batch)} "
                    f"bytes) to {peer} failed with {rc}: the peer is down or unreachable, or "
                    f"[{lo:#x}, {hi:#x}) is not inside a buffer it registered (its log says "
                    "which)",
                    code=rc,
                    peer=peer,
                )

    def close(self) -> None:
        super().close()
        self._engine = None

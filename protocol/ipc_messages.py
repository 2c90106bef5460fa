"""The address of a CUDA-IPC handoff peer (transfer/cuda_ipc.py), as a msgspec message.

A decode rank that receives over CUDA IPC exports its landing buffer once; what a prefill
process needs to map it (the IPC memory handle and torch's bookkeeping around it) travels
as this message, msgpack-encoded and base64'd into the `peer` string of LandingInfo /
RankLanding. It is data only: decoding it never runs code (no pickle).
"""

from __future__ import annotations

import base64

import msgspec

PEER_PREFIX = "cuda_ipc:"


class CudaIpcBuffer(msgspec.Struct, frozen=True):
    """One exported device buffer. `base_addr` is its first byte in the exporter's
    address space (what LandingInfo.buffer_addr and write targets refer to); the rest is
    what torch's `UntypedStorage._new_shared_cuda` needs to map its storage."""

    base_addr: int
    nbytes: int
    device: int
    storage_delta: int
    """base_addr minus the exported storage's first byte."""
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


class CudaIpcPeer(msgspec.Struct, frozen=True):
    """Everything a writer needs of one receiving process."""

    host: str
    boot_id: str
    """The kernel's boot id: CUDA IPC works only between processes of one machine."""
    pid: int
    buffers: list[CudaIpcBuffer]


def encode_peer(peer: CudaIpcPeer) -> str:
    """`cuda_ipc:<host>:<pid>:<base64 msgpack>` (host and pid readable in logs)."""
    blob = base64.urlsafe_b64encode(msgspec.msgpack.encode(peer)).decode()
    return f"{PEER_PREFIX}{peer.host}:{peer.pid}:{blob}"


def decode_peer(address: str) -> CudaIpcPeer:
    """The peer an address names; ValueError when it is not a cuda_ipc address."""
    if not address.startswith(PEER_PREFIX):
        raise ValueError(f"{address!r} is not a cuda_ipc peer address")
    blob = address.rsplit(":", 1)[-1]
    try:
        return msgspec.msgpack.decode(base64.urlsafe_b64decode(blob), type=CudaIpcPeer)
    except (ValueError, msgspec.DecodeError) as e:
        raise ValueError(f"{address[:60]!r}... is not a valid cuda_ipc peer address: {e}") from e

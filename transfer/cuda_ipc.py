"""The "cuda_ipc" transport: GPU to GPU between processes of one host, no host hop.

    decode rank (receiver)                           prefill stage (writer)
    landing buffer on its GPU                        staging slots on its GPU
    register_tensor(buffer): exported once as a      first write to a peer: decode its
      CUDA IPC handle (torch _share_cuda_); the        address, map every exported buffer
      handle rides in peer_address (msgpack,           once (_new_shared_cuda), cached per
      protocol/ipc_messages.py, never pickle)          peer
                                                     every write: ops <= 8 MiB as async
                                                       device copies on this transport's own
                                                       stream, one event after the last;
                                                       returns once the event completed
                                                       (this thread waits, not the device)

The writer's stream first waits on the calling thread's current stream, so bytes a
caller produced on it are ordered before the copies. A writer and its peer in the same
process (tests, single-process serving) write through the peer's own addresses (a
process cannot open its own IPC handle).

Only a buffer registered with `register_tensor` (a CUDA tensor) can be written into by
peers; `register_buffer(ptr, nbytes)` registers a local device range as a write source.
Failures (a malformed or foreign address, a peer process gone, a range outside what the
peer exported, a handle that does not open) are TransferErrors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol.ipc_messages import CudaIpcBuffer, CudaIpcPeer, decode_peer, encode_peer
from transfer.errors import TransferError, TransportConfigError
from transfer.transport import Transport, TransportConfig, WriteOp, register_transport


def boot_id() -> str:
    """This machine's boot id (CUDA IPC handles open only on the machine that made them)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class _DevicePtr:
    """A raw device range as a `__cuda_array_interface__` (torch wraps it without a copy;
    the device comes from the pointer's attributes)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def device_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over device memory [ptr, +nbytes) (no copy, no ownership)."""
    return torch.as_tensor(_DevicePtr(ptr, nbytes), device="cuda")


@dataclass
class _Mapped:
    """A peer process's exported buffers as mapped here."""

    peer: CudaIpcPeer
    ptrs: list[int]
    """Local address of each exported buffer's first byte (same order as peer.buffers)."""
    keep: list[Any]
    """The mapped storages: the mappings live as long as these."""


@register_transport("cuda_ipc")
class CudaIpcTransport(Transport):
    """Owns its exported tensors, the mappings of the peers it wrote to, and one CUDA
    stream per source device. `write` is thread-safe (one lock around mapping; the copies
    and the wait run outside it)."""

    def __init__(self, config: TransportConfig | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise TransportConfigError(
                "transport cuda_ipc needs CUDA devices (prefill and decode on GPUs of one "
                "host); use transfer.protocol tcp or rdma otherwise"
            )
        self._host = config.host if config is not None else "127.0.0.1"
        self._boot_id = boot_id()
        self._lock = threading.Lock()
        self._tensors: dict[int, torch.Tensor] = {}  # registered ptr -> tensor over it
        self._exports: dict[int, CudaIpcBuffer] = {}  # registered ptr -> its export
        self._peers: dict[str, _Mapped] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._address: str | None = None

    @property
    def peer_address(self) -> str:
        """Encodes every exported buffer; read it after registering the landing buffer."""
        if self._address is None:
            peer = CudaIpcPeer(self._host, self._boot_id, os.getpid(), list(self._exports.values()))
            self._address = encode_peer(peer)
        return self._address

    # -- registration -----------------------------------------------------------------------
    def register_tensor(self, tensor: Any) -> None:
        """Register a contiguous tensor; a CUDA tensor is also exported to peers."""
        if not tensor.is_contiguous():
            raise TransferError("register a contiguous tensor (its bytes are one range)")
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        self.register_buffer(ptr, nbytes)
        flat = tensor.view(-1).view(torch.uint8)
        self._tensors[ptr] = flat
        if tensor.device.type == "cuda":
            self._exports[ptr] = self._export(flat)
            self._address = None

    def _export(self, flat: torch.Tensor) -> CudaIpcBuffer:
        storage = flat.untyped_storage()
        (
            device,
            handle,
            storage_nbytes,
            storage_offset,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
        return CudaIpcBuffer(
            base_addr=flat.data_ptr(),
            nbytes=flat.numel(),
            device=int(device),
            storage_delta=flat.data_ptr() - storage.data_ptr(),
            handle=bytes(handle),
            storage_nbytes=int(storage_nbytes),
            storage_offset_bytes=int(storage_offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=None if event_handle is None else bytes(event_handle),
            event_sync_required=bool(event_sync),
        )

    def _register(self, ptr: int, nbytes: int) -> None:
        pass  # the bytes are addressable as they are; exports happen in register_tensor

    def _unregister(self, ptr: int) -> None:
        self._tensors.pop(ptr, None)
        if self._exports.pop(ptr, None) is not None:
            self._address = None

    # -- writes -------------------------------------------------------------------------------
    def _write_batch(self, peer: str, ops: Sequence[WriteOp]) -> None:
        mapped = self._mapped(peer)
        _check_alive(mapped.peer, peer)
        targets = [_translate(mapped, op, peer) for op in ops]
        try:
            pairs = [
                (self._source(op.local_ptr, op.nbytes), device_bytes(dst, op.nbytes))
                for op, dst in zip(ops, targets, strict=True)
            ]
            src0 = pairs[0][0]
            device = src0.device if src0.device.type == "cuda" else pairs[0][1].device
            stream = self._stream(device)
            done = torch.cuda.Event()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_stream(torch.cuda.current_stream(device))
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
                done.record(stream)
            done.synchronize()  # this thread waits for its own copies only
        except RuntimeError as e:
            raise TransferError(f"cuda_ipc write to {_short(peer)} failed: {e}", peer=peer) from e

    def _source(self, ptr: int, nbytes: int) -> torch.Tensor:
        for base, t in self._tensors.items():
            if base <= ptr and ptr + nbytes <= base + t.numel():
                return t[ptr - base : ptr - base + nbytes]
        return device_bytes(ptr, nbytes)  # a raw device range registered with register_buffer

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(index)
            return stream

    def _mapped(self, address: str) -> _Mapped:
        with self._lock:
            mapped = self._peers.get(address)
            if mapped is not None:
                return mapped
            try:
                peer = decode_peer(address)
            except ValueError as e:
                raise TransferError(str(e), peer=address) from e
            if peer.boot_id != self._boot_id:
                raise TransferError(
                    f"cuda_ipc peer {peer.host} (pid {peer.pid}) runs on another machine: "
                    "CUDA IPC joins processes of one host; use transfer.protocol tcp or rdma "
                    "between hosts",
                    peer=address,
                )
            _check_alive(peer, address)
            if peer.pid == os.getpid():  # our own buffers: their addresses are valid here
                mapped = _Mapped(peer, [b.base_addr for b in peer.buffers], [])
            else:
                mapped = _open(peer, address)
            self._peers[address] = mapped
            return mapped

    def close(self) -> None:
        super().close()
        with self._lock:
            self._peers.clear()
            self._streams.clear()


def _open(peer: CudaIpcPeer, address: str) -> _Mapped:
    """Map every buffer of `peer` into this process (once per peer)."""
    ptrs, keep = [], []
    torch.cuda.init()
    for b in peer.buffers:
        try:
            with torch.cuda.device(b.device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    b.device,
                    b.handle,
                    b.storage_nbytes,
                    b.storage_offset_bytes,
                    b.ref_counter_handle,
                    b.ref_counter_offset,
                    b.event_handle,
                    b.event_sync_required,
                )
        except RuntimeError as e:
            raise TransferError(
                f"cannot open the CUDA IPC handle of {peer.host} pid {peer.pid} (cuda:"
                f"{b.device}): {e}; both processes must see that GPU (CUDA_VISIBLE_DEVICES)",
                peer=address,
            ) from e
        keep.append(storage)
        ptrs.append(storage.data_ptr() + b.storage_delta)
    return _Mapped(peer, ptrs, keep)


def _translate(mapped: _Mapped, op: WriteOp, address: str) -> int:
    """This process's address of the op's target, or TransferError when the range is not
    inside one exported buffer."""
    for b, ptr in zip(mapped.peer.buffers, mapped.ptrs, strict=True):
        if b.base_addr <= op.remote_addr and op.remote_addr + op.nbytes <= b.base_addr + b.nbytes:
            return ptr + (op.remote_addr - b.base_addr)
    raise TransferError(
        f"remote range [{op.remote_addr:#x}, +{op.nbytes}) is not inside a buffer that "
        f"{_short(address)} exported",
        peer=address,
    )


def _check_alive(peer: CudaIpcPeer, address: str) -> None:
    try:
        os.kill(peer.pid, 0)
    except ProcessLookupError:
        raise TransferError(
            f"cuda_ipc peer {_short(address)} is gone (process {peer.pid} exited)", peer=address
        ) from None
    except PermissionError:
        pass  # alive, owned by another user


def _short(address: str) -> str:
    return address.rsplit(":", 1)[0]

"""The process groups of one parallel instance and the few communication patterns it uses.

    device group (default): NCCL on GPUs, gloo on CPU. Tensors of the forward: hidden
                            states between stages, TP all-reduces, DCP all-gathers.
    cpu group:              gloo. Control messages: msgpack bytes (protocol/rank_messages)
                            sent as [length int64][payload uint8], never pickle.
    dcp group:              the DCP ranks of this rank's head group (device backend).

Rendezvous: a FileStore file (all ranks of an instance share a host; nothing listens), or
tcp://host:port when the instance has a dist_port. CPU ranks need GLOO_SOCKET_IFNAME=lo on
loopback hosts (the launcher sets it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DIST_TIMEOUT_S = 600.0
"""How long a collective may wait for a peer (model loading of a slow rank included)."""


@dataclass
class ParallelContext:
    """This process's place in its instance: rank, world, device and process groups."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: dist.ProcessGroup
    dcp_group: dist.ProcessGroup | None
    """This rank's DCP group; None without DCP."""
    dcp_size: int = 1
    num_collectives: int = 0
    """Collectives of the forward this process has completed (counted by the TP model:
    a rank whose forward fails completes the rest of the step's with zeros, so the
    others never wait in one; engine/parallel/rank_isolation.py)."""

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def init_parallel(
    rank: int,
    world_size: int,
    device: torch.device | str,
    init_method: str,
    *,
    dcp_size: int = 1,
    timeout_s: float = DIST_TIMEOUT_S,
) -> ParallelContext:
    """Join the instance's process group (every rank calls this with the same arguments
    but its rank). dcp_size > 1 also forms the DCP groups of consecutive ranks."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    world = dist.group.WORLD
    assert world is not None
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo")
    dcp_group = None
    if dcp_size > 1:
        for g in range(world_size // dcp_size):  # every rank creates every group, in order
            group = dist.new_group(list(range(g * dcp_size, (g + 1) * dcp_size)))
            if g == rank // dcp_size:
                dcp_group = group
    return ParallelContext(rank, world_size, device, cpu_group, dcp_group, dcp_size)


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _as_tensor(payload: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )


def send_bytes(payload: bytes, dst: int, group: dist.ProcessGroup) -> None:
    """Blocking send of one message (returns once the receiver has it)."""
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst, group=group)
    if payload:
        dist.send(_as_tensor(payload), dst, group=group)


def recv_bytes(src: int, group: dist.ProcessGroup) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()


def broadcast_bytes(payload: bytes | None, group: dist.ProcessGroup) -> bytes:
    """Rank 0 passes the payload, the others None; everyone returns it."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    buf = (
        _as_tensor(payload)
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    if buf.numel():
        dist.broadcast(buf, 0, group=group)
    return payload if payload is not None else buf.numpy().tobytes()


class Outbox:
    """Asynchronous sends to one peer, kept alive until delivered. Sends to a peer arrive
    in order; `drain(n)` waits until at most n are pending (back-pressure)."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self._pending: deque[tuple[list[dist.Work], list[torch.Tensor]]] = deque()

    def send(
        self,
        payload: bytes,
        cpu_group: dist.ProcessGroup,
        tensor: torch.Tensor | None = None,
        device_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Queue one message: the payload on the cpu group, then `tensor` (if any) on the
        device group."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        body = _as_tensor(payload)
        works = [dist.isend(size, self.dst, group=cpu_group)]
        if body.numel():
            works.append(dist.isend(body, self.dst, group=cpu_group))
        keep = [size, body]
        if tensor is not None:
            tensor = tensor.contiguous()
            works.append(dist.isend(tensor, self.dst, group=device_group))
            keep.append(tensor)
        self._pending.append(([w for w in works if w is not None], keep))

    def drain(self, max_pending: int = 0) -> None:
        while len(self._pending) > max_pending:
            works, _ = self._pending.popleft()
            for w in works:
                w.wait()


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum over every rank of the instance, in place (device group)."""
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[size, *x.shape]: x of every rank of `group`, in rank order."""
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(out, x, group=group)  # gloo wants the flat concatenation; torch < 2.13
    return out.view(size, *x.shape)

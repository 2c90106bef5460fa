"""Conformance suite run against every registered transport (STYLE 12).

"local" writes between two transports on one LocalFabric; "mooncake" writes over tcp from
this process into a probe process (transfer.probe) on 127.0.0.1; "cuda_ipc" (marked gpu)
writes from this process's GPU memory into a probe process's exported GPU buffer. Every write is checked
byte for byte, including the bytes around it, and every failure must be a TransferError
within a bounded time, never a hang.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
import torch

from transfer import (
    MAX_OP_BYTES,
    LocalFabric,
    LocalTransport,
    TransferError,
    Transport,
    TransportConfig,
    TransportConfigError,
    create_transport,
    transport_names,
)
from transfer.probe import ProbeProcess

BUF_BYTES = 24 << 20
SIZES = [1, MAX_OP_BYTES - 1, MAX_OP_BYTES, MAX_OP_BYTES + 1, 20 << 20]
FILL = 0xAB
BOUND_S = 40.0


class Peer(Protocol):
    peer: str
    buffer_addr: int

    def fill(self, value: int) -> None: ...
    def sha256(self, offset: int, nbytes: int) -> str: ...
    def close(self) -> None: ...


class InProcessPeer:
    """A receiving LocalTransport with a registered buffer, same methods as ProbeProcess."""

    def __init__(self, fabric: LocalFabric, nbytes: int) -> None:
        self.transport = LocalTransport(fabric=fabric)
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.transport.register_buffer(self.buffer.data_ptr(), nbytes)
        self.peer = self.transport.peer_address
        self.buffer_addr = self.buffer.data_ptr()
        self.bind_address: str | None = None

    def fill(self, value: int) -> None:
        self.buffer.fill_(value)

    def sha256(self, offset: int, nbytes: int) -> str:
        return hashlib.sha256(self.buffer[offset : offset + nbytes].numpy().data).hexdigest()

    def close(self) -> None:
        self.transport.close()


@dataclass
class Pair:
    name: str
    sender: Transport
    peer: Any
    source: torch.Tensor
    dead_peer: str


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().data).hexdigest()


def _fill_sha(nbytes: int) -> str:
    return hashlib.sha256(bytes([FILL]) * nbytes).hexdigest()


def bounded(fn: Callable[[], Any], timeout_s: float = BOUND_S) -> Any:
    """Run fn in a thread; fail the test (instead of hanging) if it takes longer."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=timeout_s)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(n, marks=pytest.mark.gpu) if n == "cuda_ipc" else n for n in transport_names()
    ],
)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    name = request.param
    peer: Any
    if name == "local":
        fabric = LocalFabric()
        sender: Transport = LocalTransport(fabric=fabric)
        peer = InProcessPeer(fabric, BUF_BYTES)
        dead = "local:999999"
    elif name == "mooncake":
        config = TransportConfig(name="mooncake", host="127.0.0.1", protocol="tcp")
        peer = ProbeProcess(config, BUF_BYTES)
        sender = create_transport(config)
        dead = "127.0.0.1:1"
    elif name == "cuda_ipc":
        config = TransportConfig(name="cuda_ipc", host="127.0.0.1")
        with ProbeProcess(config, 4096, device="cuda") as gone:
            dead = gone.peer  # a well-formed address of a process that has exited
        peer = ProbeProcess(config, BUF_BYTES, device="cuda")
        sender = create_transport(config)
    else:
        raise AssertionError(f"transport {name!r} has no conformance harness: add one here")
    source = torch.randint(
        0, 256, (BUF_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    if name == "cuda_ipc":
        source = source.cuda()
    sender.register_buffer(source.data_ptr(), BUF_BYTES)
    try:
        yield Pair(name, sender, peer, source, dead)
    finally:
        sender.close()
        peer.close()


@pytest.mark.parametrize("nbytes", SIZES)
def test_write_is_byte_exact_with_ceil_ops(pair: Pair, nbytes: int) -> None:
    local_off, remote_off = 7, 3  # unaligned on both ends
    pair.peer.fill(FILL)
    stats = bounded(
        lambda: pair.sender.write(
            pair.peer.peer,
            pair.source.data_ptr() + local_off,
            pair.peer.buffer_addr + remote_off,
            nbytes,
        )
    )
    assert stats.num_bytes == nbytes
    assert stats.num_ops == math.ceil(nbytes / MAX_OP_BYTES)
    assert stats.seconds > 0
    assert pair.peer.sha256(remote_off, nbytes) == _sha(pair.source[local_off : local_off + nbytes])
    assert pair.peer.sha256(0, remote_off) == _fill_sha(remote_off)
    assert pair.peer.sha256(remote_off + nbytes, 4096) == _fill_sha(4096)


def test_zero_byte_write_moves_nothing(pair: Pair) -> None:
    stats = pair.sender.write(pair.peer.peer, pair.source.data_ptr(), pair.peer.buffer_addr, 0)
    assert (stats.num_bytes, stats.num_ops) == (0, 0)


def test_out_of_range_remote_raises(pair: Pair) -> None:
    end = pair.peer.buffer_addr + BUF_BYTES
    with pytest.raises(TransferError):
        bounded(lambda: pair.sender.write(pair.peer.peer, pair.source.data_ptr(), end - 10, 100))


def test_unregistered_remote_raises(pair: Pair) -> None:
    with pytest.raises(TransferError):
        bounded(lambda: pair.sender.write(pair.peer.peer, pair.source.data_ptr(), 4096, 100))


def test_unknown_peer_raises(pair: Pair) -> None:
    with pytest.raises(TransferError):
        bounded(lambda: pair.sender.write(pair.dead_peer, pair.source.data_ptr(), 4096, 100))


def test_unregistered_local_raises(pair: Pair) -> None:
    stray = torch.ones(100, dtype=torch.uint8, device=pair.source.device)
    with pytest.raises(TransferError, match="not inside a buffer registered"):
        pair.sender.write(pair.peer.peer, stray.data_ptr(), pair.peer.buffer_addr, 100)


def test_overlapping_registration_raises(pair: Pair) -> None:
    with pytest.raises(TransferError, match="overlaps"):
        pair.sender.register_buffer(pair.source.data_ptr() + 10, 100)


def test_writes_work_after_a_failure(pair: Pair) -> None:
    with pytest.raises(TransferError):
        bounded(lambda: pair.sender.write(pair.peer.peer, pair.source.data_ptr(), 4096, 8))
    pair.peer.fill(FILL)
    bounded(
        lambda: pair.sender.write(
            pair.peer.peer, pair.source.data_ptr(), pair.peer.buffer_addr, 4096
        )
    )
    assert pair.peer.sha256(0, 4096) == _sha(pair.source[:4096])


def test_addresses_are_loopback(pair: Pair) -> None:
    if pair.name == "local":
        assert pair.peer.peer.startswith("local:")
        return
    if pair.name == "cuda_ipc":
        assert pair.peer.peer.startswith("cuda_ipc:127.0.0.1:")
        return
    assert pair.peer.bind_address == "127.0.0.1"  # MC_TCP_BIND_ADDRESS in the receiver
    assert pair.peer.peer.startswith("127.0.0.1:")
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"  # ... and in this process
    assert pair.sender.peer_address.startswith("127.0.0.1:")


def test_mooncake_refuses_wildcard_host() -> None:
    with pytest.raises(TransportConfigError, match="wildcard"):
        TransportConfig(name="mooncake", host="0.0.0.0")


def test_mooncake_refuses_conflicting_bind_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.2")
    with pytest.raises(TransportConfigError, match="MC_TCP_BIND_ADDRESS"):
        create_transport(TransportConfig(name="mooncake", host="127.0.0.1"))


def test_unknown_transport_and_protocol_are_config_errors() -> None:
    with pytest.raises(TransportConfigError, match="valid"):
        TransportConfig(name="carrier-pigeon")
    with pytest.raises(TransportConfigError, match="protocol"):
        TransportConfig(name="mooncake", protocol="udp")


# More than the kernel's loopback socket buffers hold (tcp_rmem max + tcp_wmem max).
STALLED_WRITE_BYTES = 96 << 20


def test_mooncake_stalled_peer_fails_within_the_write_timeout() -> None:
    """A decode process that stops answering (SIGSTOP) fails the write, bounded by
    write_timeout_s; the same transport works again once the peer resumes.

    The stalled write is larger than loopback's socket buffers can take (tcp_rmem's
    ceiling is 32 MiB here, tcp_wmem's 4 MiB): a 1 MiB write could land in the stopped
    peer's receive buffer and succeed."""
    nbytes = STALLED_WRITE_BYTES
    config = TransportConfig(name="mooncake", host="127.0.0.1", write_timeout_s=5)
    with ProbeProcess(config, nbytes) as peer:
        sender = create_transport(config)
        source = torch.zeros(nbytes, dtype=torch.uint8)
        sender.register_buffer(source.data_ptr(), nbytes)
        try:
            sender.write(peer.peer, source.data_ptr(), peer.buffer_addr, 4096)
            os.kill(peer.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(TransferError):
                    bounded(
                        lambda: sender.write(peer.peer, source.data_ptr(), peer.buffer_addr, nbytes)
                    )
                assert 4 < time.monotonic() - start < 15
            finally:
                os.kill(peer.pid, signal.SIGCONT)
            bounded(lambda: sender.write(peer.peer, source.data_ptr(), peer.buffer_addr, 4096))
        finally:
            sender.close()

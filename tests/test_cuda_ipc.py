"""The cuda_ipc transport and decode's GPU landing.

CPU: the peer address is a msgspec message (never pickle) and a bad one is a clear error;
cluster.yaml's transfer.protocol picks the transport; without CUDA the transport refuses
to start with a message that says what to use instead.

GPU (-m gpu, the lent machine): the real HandoffSender gathers paged KV on the GPU and
writes it through cuda_ipc into a landing ring on the decode GPU (smaller than the prompt,
so it turns); the decode stand-in scatters every piece GPU to GPU and waits for the
scatter's event before answering, as decode_worker's LandingWorker does. The KV decode
holds must equal prefill's bit for bit. (The conformance suite runs cuda_ipc across two
processes: tests/test_transport_conformance.py.)
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from protocol.ipc_messages import CudaIpcBuffer, CudaIpcPeer, decode_peer, encode_peer
from protocol.kv_layout import KVLayout
from protocol.messages import FlowClosed, HandoffNotice, LandingInfo, SegmentsLanded
from transfer import (
    FlowCoverage,
    HandoffSender,
    LandingArena,
    TransferError,
    TransportConfig,
    TransportConfigError,
    create_transport,
    handoff_transport_config,
    scatter_segments,
)

L, H, D, BS = 4, 2, 64, 16
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype="bfloat16")


def test_peer_address_round_trips_as_msgpack_and_names_host_and_pid():
    buf = CudaIpcBuffer(0x7F00_0000_0000, 1 << 20, 0, 0, b"\x01" * 64, 2 << 20, 0, b"/rc", 8)
    peer = CudaIpcPeer("127.0.0.1", "boot-1", 4242, [buf])
    address = encode_peer(peer)
    assert address.startswith("cuda_ipc:127.0.0.1:4242:")
    assert decode_peer(address) == peer
    payload = address.rsplit(":", 1)[-1]
    assert b"pickle" not in payload.encode() and "\n" not in address


@pytest.mark.parametrize("bad", ["127.0.0.1:15001", "cuda_ipc:h:1:!!!", "cuda_ipc:h:1:AAAA"])
def test_a_bad_peer_address_is_a_value_error(bad: str):
    with pytest.raises(ValueError, match="cuda_ipc peer address"):
        decode_peer(bad)


def test_protocol_picks_the_transport():
    assert handoff_transport_config("cuda_ipc", "127.0.0.1").name == "cuda_ipc"
    tcp = handoff_transport_config("tcp", "127.0.0.1")
    assert (tcp.name, tcp.protocol) == ("mooncake", "tcp")
    assert handoff_transport_config("rdma", "10.0.0.1").protocol == "rdma"


def test_without_cuda_the_transport_refuses_to_start_clearly():
    config = TransportConfig(name="cuda_ipc", host="127.0.0.1")
    if torch.cuda.is_available():  # the GPU machine: it starts, and rejects a bad peer
        transport = create_transport(config)
        src = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        transport.register_buffer(src.data_ptr(), 4096)
        with pytest.raises(TransferError, match="not a cuda_ipc peer"):
            transport.write("127.0.0.1:15001", src.data_ptr(), 4096, 16)
        transport.close()
        return
    with pytest.raises(TransportConfigError, match="needs CUDA devices"):
        create_transport(config)


def test_landing_arena_is_host_memory_unless_told():
    arena = LandingArena(1 << 20)
    assert arena.buffer.device.type == "cpu"
    arena.close()


# -- GPU --------------------------------------------------------------------------------------


class GpuDecode:
    """Decode stand-in on the GPU: one rank, its landing arena on the GPU exported through
    its own cuda_ipc transport, paged caches on the GPU."""

    def __init__(self, region_bytes: int) -> None:
        self.transport = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
        self.arena = LandingArena(
            64 << 20, self.transport, max_region_bytes=region_bytes, device="cuda"
        )
        self.caches = [
            torch.zeros(2, 64, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)
        ]
        self.closed: dict[str, FlowClosed] = {}
        self.coverage: dict[str, FlowCoverage] = {}
        self.regions: dict[str, object] = {}
        self.lock = threading.Lock()

    def landing(self, rid: str, num_tokens: int) -> list[LandingInfo]:
        self.coverage[rid] = FlowCoverage(1, L, num_tokens)
        region = self.arena.allocate(rid, num_tokens * LAYOUT.bytes_per_token, 1)
        assert region is not None
        self.regions[rid] = region
        return [self.arena.landing_info(region, 0, LAYOUT)]

    def notify(self, url: str, notice: HandoffNotice) -> bool:
        with self.lock:
            if isinstance(notice, FlowClosed):
                self.closed[notice.request_id] = notice
                return True
            assert isinstance(notice, SegmentsLanded)
            cov = self.coverage[notice.request_id]
            for seg in notice.segments:
                assert cov.check(seg) is None
                cov.add(seg)
            region = self.regions[notice.request_id]
            table = list(range(64))
            scatter_segments(region, notice.segments, LAYOUT, self.caches, table)  # type: ignore[arg-type]
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            done.synchronize()  # the ring bytes are read before they are released
            return True


@pytest.mark.gpu
def test_kv_lands_exactly_on_the_decode_gpu_through_a_small_ring():
    torch.manual_seed(0)
    cache = [torch.randn(2, 64, BS, H, D, device="cuda").to(torch.bfloat16) for _ in range(L)]
    n = 900
    decode = GpuDecode(region_bytes=128 * LAYOUT.bytes_per_token)  # the ring turns ~7 times
    sender_transport = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
    sender = HandoffSender(sender_transport, 4 << 20, cache, (0, L), notify=decode.notify)
    try:
        assert sender.staging.is_cuda and decode.arena.buffer.is_cuda
        table = list(range(63, -1, -1))
        sender.open("r1", decode.landing("r1", n), n, "decode")
        for a in range(0, n, 256):
            sender.submit("r1", a, min(n, a + 256), table, last=a + 256 >= n)
        deadline = time.monotonic() + 30
        results = []
        while not results and time.monotonic() < deadline:
            sender.wait_finished(0.05)
            results = sender.finished()
        assert results and results[0].error is None
        assert results[0].num_bytes == n * LAYOUT.bytes_per_token
        assert decode.coverage["r1"].complete
        slots = torch.tensor([table[t // BS] * BS + t % BS for t in range(n)], device="cuda")
        for layer in range(L):
            want = cache[layer].flatten(1, 2)[:, slots]
            got = decode.caches[layer].flatten(1, 2)[:, :n]
            assert torch.equal(got, want), f"layer {layer} differs"
    finally:
        sender.close()
        decode.arena.close()


@pytest.mark.gpu
def test_a_write_outside_the_exported_landing_fails_only_that_write():
    transport = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
    landing = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    receiver = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
    receiver.register_tensor(landing)
    src = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    transport.register_tensor(src)
    with pytest.raises(TransferError, match="not inside a buffer"):
        transport.write(receiver.peer_address, src.data_ptr(), landing.data_ptr() + 4096, 1 << 20)
    transport.write(receiver.peer_address, src.data_ptr(), landing.data_ptr(), 1 << 20)
    assert int(landing.sum()) == 7 << 20
    peer = msgspec.msgpack.encode(decode_peer(receiver.peer_address))
    assert len(peer) < 512  # small enough for every LandingInfo
    transport.close()
    receiver.close()

"""HandoffSender -> landing -> scatter_segments, end to end: streamed chunks, staging
smaller than a segment (whole-row and sub-row pieces), op counts, errors, and a send over
Mooncake tcp into another process."""

from __future__ import annotations

import hashlib
import math
import random

import pytest
import torch

from protocol.kv_layout import KVLayout
from protocol.messages import LandingInfo
from transfer import (
    MAX_OP_BYTES,
    HandoffSender,
    LandingArena,
    LocalTransport,
    PackLayoutError,
    TransportConfig,
    create_transport,
    gather,
    scatter_segments,
)
from transfer.probe import ProbeProcess

L, NUM_BLOCKS, BS, H, D = 4, 64, 16, 2, 16
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype="float32")
TOKEN_BYTES = LAYOUT.bytes_per_token  # 1024


def prefill_cache(seed: int) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(2, NUM_BLOCKS, BS, H, D, generator=g) for _ in range(L)]
    return kv, random.Random(seed).sample(range(NUM_BLOCKS), NUM_BLOCKS)


def packed(kv: list[torch.Tensor], table: list[int], start: int, end: int) -> torch.Tensor:
    out = torch.empty(L, 2, end - start, H, D)
    gather(kv, table, start, end, out)
    return out


@pytest.mark.parametrize(
    "staging_bytes",
    [1 << 20, 3 * 100 * H * D * 4, 1000, H * D * 4],
    ids=["fits", "whole-rows", "sub-rows", "one-token"],
)
def test_streamed_handoff_round_trip(staging_bytes: int) -> None:
    num_tokens = 333
    transport = LocalTransport()  # one transport owns staging and landing (single process)
    sender = HandoffSender(transport, staging_bytes)
    arena = LandingArena(1 << 20, transport)
    region = arena.allocate("req", num_tokens * TOKEN_BYTES, timeout_s=0)
    assert region is not None
    landing = arena.landing_info(region, rank=0, layout=LAYOUT)
    kv, table = prefill_cache(0)

    segments, offset = [], 0
    for start in range(0, num_tokens, 128):  # one send per prefill chunk
        seg, stats = sender.send(kv, table, start, min(start + 128, num_tokens), landing, offset)
        assert stats.num_bytes == seg.num_bytes == (seg.token_end - start) * TOKEN_BYTES
        segments.append(seg)
        offset += seg.num_bytes

    decode_kv = [torch.zeros_like(x) for x in kv]
    decode_table = list(range(NUM_BLOCKS))
    scatter_segments(region, segments, LAYOUT, decode_kv, decode_table)
    assert torch.equal(
        packed(decode_kv, decode_table, 0, num_tokens), packed(kv, table, 0, num_tokens)
    )
    arena.free("req")


def test_segment_that_fits_staging_costs_ceil_ops() -> None:
    num_blocks = 640
    n = num_blocks * BS  # 10240 tokens = 10 MiB: 2 ops
    kv = [torch.randn(2, num_blocks, BS, H, D) for _ in range(L)]
    transport = LocalTransport()
    sender = HandoffSender(transport, 16 << 20)
    arena = LandingArena(16 << 20, transport)
    region = arena.allocate("r", n * TOKEN_BYTES, timeout_s=0)
    assert region is not None
    landing = arena.landing_info(region, 0, LAYOUT)
    _, stats = sender.send(kv, list(range(num_blocks)), 0, n, landing, 0)
    assert stats.num_ops == math.ceil(n * TOKEN_BYTES / MAX_OP_BYTES) == 2


def test_send_validates_against_the_landing() -> None:
    transport = LocalTransport()
    sender = HandoffSender(transport, 1 << 16)
    arena = LandingArena(1 << 16, transport)
    region = arena.allocate("r", 10 * TOKEN_BYTES, timeout_s=0)
    assert region is not None
    kv, table = prefill_cache(1)
    with pytest.raises(PackLayoutError, match="exceeds the landing region"):
        sender.send(kv, table, 0, 20, arena.landing_info(region, 0, LAYOUT), 0)
    wrong = KVLayout(num_layers=L + 1, num_kv_heads=H, head_dim=D, block_size=BS, dtype="float32")
    with pytest.raises(PackLayoutError, match="does not match"):
        sender.send(kv, table, 0, 4, arena.landing_info(region, 0, wrong), 0)


def test_send_over_mooncake_into_another_process() -> None:
    config = TransportConfig(name="mooncake", host="127.0.0.1", protocol="tcp")
    kv, table = prefill_cache(2)
    num_tokens = 700
    with ProbeProcess(config, 1 << 20) as probe:
        transport = create_transport(config)
        try:
            sender = HandoffSender(transport, 200 * TOKEN_BYTES)  # forces 4 pieces
            landing = probe_landing(probe)
            seg, stats = sender.send(kv, table, 0, num_tokens, landing, 0)
            assert stats.num_bytes == num_tokens * TOKEN_BYTES
            want = packed(kv, table, 0, num_tokens).numpy().tobytes()
            assert probe.sha256(0, seg.num_bytes) == hashlib.sha256(want).hexdigest()
        finally:
            transport.close()


def probe_landing(probe: ProbeProcess) -> LandingInfo:
    """The probe's whole buffer as one landing region."""
    return LandingInfo(
        rank=0,
        transport="mooncake",
        peer=probe.peer,
        buffer_addr=probe.buffer_addr,
        capacity_bytes=probe.nbytes,
        layout=LAYOUT,
    )

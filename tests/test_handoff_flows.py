"""Handoff flows between a prefill pipeline and TP x DCP decode ranks, in one process over
the local transport with KV large enough for multi-op segments: flows = stages x ranks,
bytes per flow = stage layers x rank tokens x rank heads, ops per flow segment =
ceil(bytes / 8 MiB), and every rank's pages hold exactly its stripe of its heads."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from protocol.kv_layout import KVLayout
from protocol.messages import LandingInfo
from protocol.parallel import decode_rank_shards, stage_layer_ranges, stripe_len
from transfer import (
    MAX_OP_BYTES,
    HandoffSender,
    KVShard,
    LandingArena,
    LocalFabric,
    LocalTransport,
    check_flows,
    scatter_segments,
    send_flows,
)
from transfer.transport import WriteOp

L, HQ, HKV, D, BS = 4, 8, 4, 64, 16
NUM_TOKENS = 9000  # 2 layers x 9000 tokens x 4 heads x 512 B = 36 MiB for a DCP-1 rank


class CountingTransport(LocalTransport):
    """A local transport that counts the ops it writes to each peer."""

    def __init__(self, fabric: LocalFabric) -> None:
        super().__init__(fabric=fabric)
        self.ops: Counter[str] = Counter()

    def _write_batch(self, peer: str, ops: Sequence[WriteOp]) -> None:
        self.ops[peer] += len(ops)
        super()._write_batch(peer, ops)


@pytest.fixture(scope="module")
def prefill_kv() -> tuple[list[torch.Tensor], list[int]]:
    """All layers of a full-model paged cache holding NUM_TOKENS tokens."""
    g = torch.Generator().manual_seed(0)
    num_blocks = -(-NUM_TOKENS // BS) + 3
    kv = [torch.randn(2, num_blocks, BS, HKV, D, generator=g) for _ in range(L)]
    table = torch.randperm(num_blocks, generator=g)[: -(-NUM_TOKENS // BS)].tolist()
    return kv, table


@pytest.mark.parametrize(
    ("tp", "dcp", "split"), [(2, 1, (2, 2)), (2, 2, (3, 1)), (4, 4, (1, 1, 1, 1))]
)
def test_flows_bytes_ops_and_scatter(prefill_kv, tp: int, dcp: int, split: tuple[int, ...]) -> None:
    kv, table = prefill_kv
    fabric = LocalFabric()
    shards = decode_rank_shards(HQ, HKV, tp, dcp)
    layouts, arenas, landings, transports = [], [], [], []
    for s in shards:
        layout = KVLayout(
            num_layers=L, num_kv_heads=s.num_kv_heads, head_dim=D, block_size=BS, dtype="float32"
        )
        nbytes = stripe_len(0, NUM_TOKENS, dcp, s.dcp_rank) * layout.bytes_per_token
        t = LocalTransport(fabric=fabric)
        arena = LandingArena(-(-nbytes // 4096) * 4096, t)
        region = arena.allocate("r", nbytes, timeout_s=0)
        assert region is not None
        landings.append(
            LandingInfo(
                rank=s.rank,
                transport=t.name,
                peer=t.peer_address,
                buffer_addr=region.addr,
                capacity_bytes=region.nbytes,
                layout=layout,
                kv_head_start=s.kv_head_start,
                dcp_size=dcp,
                dcp_rank=s.dcp_rank,
            )
        )
        layouts.append(layout)
        arenas.append((arena, region))
        transports.append(t)

    segments = []
    chunk = 6000  # streamed: two steps, the first of more than 8 MiB per flow
    for l0, l1 in stage_layer_ranges(split):
        sender_t = CountingTransport(fabric)
        sender = HandoffSender(sender_t, 64 << 20)
        for a, b in ((0, chunk), (chunk, NUM_TOKENS)):
            segs, stats = send_flows(sender, kv[l0:l1], (l0, l1), table, a, b, landings, NUM_TOKENS)
            assert len(segs) == tp  # one segment per flow (rank) of this stage
            assert stats.num_ops == sum(math.ceil(s.num_bytes / MAX_OP_BYTES) for s in segs)
            segments += segs
            for s, landing in zip(segs, landings, strict=True):
                want = stripe_len(a, b, dcp, landing.dcp_rank) * (l1 - l0)
                assert s.num_bytes == want * landing.layout.bytes_per_token_per_layer
        for landing in landings:  # ops per flow: ceil(bytes / 8 MiB) per streamed segment
            flow = [s for s in segments if s.rank == landing.rank and s.layer_start == l0]
            assert sender_t.ops[landing.peer] == sum(
                math.ceil(s.num_bytes / MAX_OP_BYTES) for s in flow
            )
    flows = {(s.rank, s.layer_start, s.layer_end) for s in segments}
    assert len(flows) == len(split) * tp
    if dcp == 1:
        assert max(s.num_bytes for s in segments) > MAX_OP_BYTES  # multi-op segments ran
    assert check_flows(segments, NUM_TOKENS, tp, L) is None
    assert "does not continue" in (check_flows(segments[1:], NUM_TOKENS, tp, L) or "")
    last_stage = [x for x in segments if x.layer_end != L]
    assert "layers" in (check_flows(last_stage, NUM_TOKENS, tp, L) or "")

    for s, layout, (arena, region) in zip(shards, layouts, arenas, strict=True):
        n_local = stripe_len(0, NUM_TOKENS, dcp, s.dcp_rank)
        local_blocks = -(-n_local // BS)
        caches = [torch.zeros(2, local_blocks + 2, BS, s.num_kv_heads, D) for _ in range(L)]
        # The rank-local table: local block j holds local positions j*BS .. (virtual blocks)
        local_table = list(range(2, 2 + local_blocks))
        mine = [seg for seg in segments if seg.rank == s.rank]
        scatter_segments(
            region, mine, layout, caches, local_table, KVShard(dcp_size=dcp, dcp_rank=s.dcp_rank)
        )
        for t in range(s.dcp_rank, NUM_TOKENS, max(1, NUM_TOKENS // 97) * dcp):
            j = t // dcp
            for layer in (0, L - 1):
                got = caches[layer][:, local_table[j // BS], j % BS]
                want = kv[layer][:, table[t // BS], t % BS, s.kv_head_start : s.kv_head_end]
                assert torch.equal(got, want), (s.rank, t, layer)
        arena.close()

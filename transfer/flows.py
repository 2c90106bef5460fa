"""Handoff flows (DESIGN §6): one flow per (prefill stage, decode rank), carrying the
stage's layers x the rank's tokens (DCP stripe) x the rank's KV heads.

Where a flow's segments sit in the rank's landing region (one region per rank, the same
size on every rank, allocated by decode rank 0):

    rank r's region, n_r = stripe_len(0, num_prompt_tokens) tokens of the rank,
    B = layout.bytes_per_token_per_layer (the rank's heads):

    | stage 0: layers [0, 8)            | stage 1: layers [8, 16)           | ...
    | seg [0,c0) | seg [c0,c1) | ...    | seg [0,c0) | seg [c0,c1) | ...    |
    ^ 0                                 ^ n_r * 8 * B
      segment of tokens [a, b) of stage s starts at
          n_r * layer_start_s * B  +  stripe_len(0, a) * num_layers_s * B

The offset depends only on the segment, so every stage places its segments without
talking to the others, and streamed chunks (one segment per prefill step) never collide.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from protocol.kv_layout import KVLayout
from protocol.messages import KVSegment, LandingInfo
from protocol.parallel import stripe_len
from transfer.kv_pack import KVShard
from transfer.sender import HandoffSender
from transfer.transport import WriteStats


def shard_of(landing: LandingInfo) -> KVShard:
    """The heads and token stripe the landing's rank holds."""
    return KVShard(
        landing.kv_head_start,
        landing.kv_head_start + landing.layout.num_kv_heads,
        landing.dcp_size,
        landing.dcp_rank,
    )


def rank_landing_bytes(layout: KVLayout, dcp_size: int, dcp_rank: int, num_tokens: int) -> int:
    """Bytes of a prompt of `num_tokens` tokens in a rank's landing region (all layers)."""
    return stripe_len(0, num_tokens, dcp_size, dcp_rank) * layout.bytes_per_token


def flow_offset(
    landing: LandingInfo,
    num_prompt_tokens: int,
    layers: tuple[int, int],
    token_start: int,
) -> int:
    """Landing offset of the segment of tokens [token_start, ...) of the stage holding
    `layers` (diagram above)."""
    per_layer = landing.layout.bytes_per_token_per_layer
    n_rank = stripe_len(0, num_prompt_tokens, landing.dcp_size, landing.dcp_rank)
    before = stripe_len(0, token_start, landing.dcp_size, landing.dcp_rank)
    l0, l1 = layers
    return (n_rank * l0 + before * (l1 - l0)) * per_layer


def send_flows(
    sender: HandoffSender,
    kv_caches: list[torch.Tensor],
    layers: tuple[int, int],
    block_table: list[int],
    token_start: int,
    token_end: int,
    landings: list[LandingInfo],
    num_prompt_tokens: int,
) -> tuple[list[KVSegment], WriteStats]:
    """One stage's part of a handoff step: tokens [token_start, token_end) of the stage's
    layers (kv_caches hold exactly `layers`) to every decode rank. Returns the segments
    (one per rank) and what moved. Raises PackLayoutError / TransferError."""
    segments = []
    total = WriteStats()
    for landing in landings:
        offset = flow_offset(landing, num_prompt_tokens, layers, token_start)
        seg, stats = sender.send(
            kv_caches,
            block_table,
            token_start,
            token_end,
            landing,
            offset,
            shard_of(landing),
            layers,
        )
        segments.append(seg)
        total += stats
    return segments, total


def check_flows(
    segments: list[KVSegment], num_prompt_tokens: int, num_ranks: int, num_layers: int
) -> str | None:
    """Why the segments are not a complete handoff, or None: for every rank, the layer
    ranges must cut [0, num_layers) and each range's segments tile [0, num_prompt_tokens)
    in order (so decode starts a request only when every flow has landed)."""
    by_rank: dict[int, dict[tuple[int, int], list[KVSegment]]] = defaultdict(dict)
    for seg in segments:
        if not 0 <= seg.rank < num_ranks:
            return f"segment {seg} names rank {seg.rank}; this instance has {num_ranks}"
        layers = (seg.layer_start, num_layers if seg.layer_end is None else seg.layer_end)
        by_rank[seg.rank].setdefault(layers, []).append(seg)
    for rank in range(num_ranks):
        flows = by_rank.get(rank, {})
        at = 0
        for l0, l1 in sorted(flows):
            if l0 != at or l1 <= l0:
                return f"rank {rank}: layers [{l0}, {l1}) do not continue at layer {at}"
            at = l1
        if at != num_layers:
            return f"rank {rank}: segments cover {at} of {num_layers} layers"
        for (l0, l1), segs in flows.items():
            tok = 0
            for seg in segs:
                if seg.token_start != tok or seg.token_end <= seg.token_start:
                    return f"rank {rank} layers [{l0}, {l1}): {seg} does not continue at {tok}"
                tok = seg.token_end
            if tok != num_prompt_tokens:
                return (
                    f"rank {rank} layers [{l0}, {l1}): segments cover {tok} of "
                    f"{num_prompt_tokens} prompt tokens"
                )
    return None

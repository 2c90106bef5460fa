"""Handoff flows (DESIGN §6): one flow per (prefill stage, decode rank), carrying the
stage's layers x the rank's tokens (DCP stripe) x the rank's KV heads.

Every flow streams its pieces through its stage's part of the rank's landing ring
(transfer/ring.py), in token order. Decode tracks, per rank and layer, how far the landed
pieces reach (`FlowCoverage`): the handoff is complete when every layer of every rank
reached the prompt's end, whatever the prefill's layer split was.
"""

from __future__ import annotations

from protocol.kv_layout import KVLayout
from protocol.messages import KVSegment, LandingInfo
from protocol.parallel import stripe_len
from transfer.kv_pack import KVShard


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


class FlowCoverage:
    """Owns how far the landed segments of one request reach, per (rank, layer)."""

    def __init__(self, num_ranks: int, num_layers: int, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_layers = num_layers
        self._upto = [[0] * num_layers for _ in range(num_ranks)]

    def check(self, seg: KVSegment) -> str | None:
        """Why `seg` cannot come next, or None."""
        if not 0 <= seg.rank < len(self._upto):
            return f"segment {seg} names rank {seg.rank}; this instance has {len(self._upto)}"
        l1 = self.num_layers if seg.layer_end is None else seg.layer_end
        if not 0 <= seg.layer_start < l1 <= self.num_layers:
            return f"segment {seg} has layers outside [0, {self.num_layers})"
        if not 0 <= seg.token_start < seg.token_end <= self.num_prompt_tokens:
            return f"segment {seg} is outside the prompt's {self.num_prompt_tokens} tokens"
        for layer in range(seg.layer_start, l1):
            if self._upto[seg.rank][layer] != seg.token_start:
                return (
                    f"segment {seg} does not continue rank {seg.rank} layer {layer} at "
                    f"token {self._upto[seg.rank][layer]}"
                )
        return None

    def add(self, seg: KVSegment) -> None:
        """Record a landed segment (check() first)."""
        l1 = self.num_layers if seg.layer_end is None else seg.layer_end
        for layer in range(seg.layer_start, l1):
            self._upto[seg.rank][layer] = seg.token_end

    @property
    def landed_tokens(self) -> int:
        """Prompt tokens [0, n) every rank holds in every layer."""
        return min(min(row) for row in self._upto)

    @property
    def complete(self) -> bool:
        return self.landed_tokens == self.num_prompt_tokens

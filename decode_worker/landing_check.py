"""Decode's check of a landed piece against the region it reserved for the request,
before anything is scattered (POST /kv_notify, SegmentsLanded).

A prefill stage says where in the request's landing region it wrote each segment; decode
scatters from there into the request's pages. So every segment must lie inside THAT
region and be exactly its tokens x layers of the rank's layout: a notice naming bytes
outside it (another request's region, the arena's end) is refused with a 400, and
nothing is read.
"""

from __future__ import annotations

from protocol.kv_layout import KVLayout
from protocol.messages import KVSegment
from protocol.parallel import stripe_len


def segment_problem(
    seg: KVSegment,
    region_nbytes: int,
    layout: KVLayout,
    stripes: list[tuple[int, int]],
) -> str | None:
    """Why `seg` may not be scattered from a region of `region_nbytes` bytes, or None.
    `stripes[r]`: decode rank r's (dcp_size, dcp_rank)."""
    if not 0 <= seg.rank < len(stripes):
        return f"segment {seg} names rank {seg.rank}; this instance has {len(stripes)}"
    l1 = layout.num_layers if seg.layer_end is None else seg.layer_end
    if not 0 <= seg.layer_start < l1 <= layout.num_layers:
        return f"segment {seg} has layers outside [0, {layout.num_layers})"
    if seg.token_start < 0 or seg.token_end <= seg.token_start:
        return f"segment {seg} has an empty or negative token range"
    dcp_size, dcp_rank = stripes[seg.rank]
    n = stripe_len(seg.token_start, seg.token_end, dcp_size, dcp_rank)
    want = n * (l1 - seg.layer_start) * layout.bytes_per_token_per_layer
    if seg.num_bytes != want:
        return (
            f"segment {seg} carries {seg.num_bytes} bytes; {n} tokens x "
            f"{l1 - seg.layer_start} layers of rank {seg.rank} need {want}"
        )
    if seg.offset_bytes < 0 or seg.offset_bytes + seg.num_bytes > region_nbytes:
        return (
            f"segment {seg} lies outside the {region_nbytes}-byte landing region this "
            "instance reserved for the request"
        )
    return None

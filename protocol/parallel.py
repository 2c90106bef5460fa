"""Parallel layouts (DESIGN §6): which layers a prefill stage holds, which KV heads, query
heads and tokens a decode rank holds. Torch-free: the cluster checks, the prefill handoff
and the engine's rank processes all compute layouts here, so they agree by construction.

Prefill PP = N: stage s holds layers [start_s, end_s) of every token and every head.

    layer_split (8, 8, 7, 7) of 30 layers:  stage 0 [0, 8)  1 [8, 16)  2 [16, 23)  3 [23, 30)

Decode TP x DCP: the TP ranks form G = TP / DCP head groups of DCP consecutive ranks;
group g holds KV heads kv(g), and rank r = g * DCP + d of it holds the tokens t ≡ d
(mod DCP) of those heads, for all layers, at local position t // DCP:

    TP 4, DCP 2, 8 query / 4 KV heads:   G = 2
        rank   group  dcp  KV heads  group's query heads  owned query heads  tokens
        0      0      0    0-1       0-3                  0-1                t even
        1      0      1    0-1       0-3                  2-3                t odd
        2      1      0    2-3       4-7                  4-5                t even
        3      1      1    2-3       4-7                  6-7                t odd

Every rank of a group computes attention of all the group's query heads over its own
tokens; the partial outputs are merged by log-sum-exp across the group, and each rank
keeps its owned query heads for the row-parallel o_proj. With fewer KV heads than groups
(G > Hkv) each KV head is replicated on G / Hkv groups, as vLLM does; then G must divide
the query heads. Owned query heads split a group's heads as evenly as possible (SmolLM2's
9 heads over DCP 2: 5 + 4), so only the KV heads need to divide.
"""

from __future__ import annotations

import msgspec


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of [0, n) cut into `parts` contiguous ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def even_layer_split(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible, earlier stages one more (the last stage also
    runs the final norm and lm_head): 30 over 4 -> (8, 8, 7, 7)."""
    return tuple(
        b - a for a, b in (split_range(num_layers, num_stages, s) for s in range(num_stages))
    )


def stage_layer_ranges(layer_split: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) of every stage's layers."""
    out, at = [], 0
    for n in layer_split:
        out.append((at, at + n))
        at += n
    return out


def layer_split_error(layer_split: tuple[int, ...], num_layers: int) -> str | None:
    """Why `layer_split` is not a split of `num_layers` layers, or None."""
    if any(n <= 0 for n in layer_split):
        return f"{list(layer_split)} has a stage without layers; every stage needs >= 1"
    if sum(layer_split) != num_layers:
        return (
            f"{list(layer_split)} covers {sum(layer_split)} layers but the model has "
            f"{num_layers}; the entries must sum to {num_layers}"
        )
    return None


def stripe_len(token_start: int, token_end: int, dcp_size: int, dcp_rank: int) -> int:
    """How many t in [token_start, token_end) have t ≡ dcp_rank (mod dcp_size)."""
    first = token_start + (dcp_rank - token_start) % dcp_size
    return max(0, -(-(token_end - first) // dcp_size))


class DecodeRankShard(msgspec.Struct, frozen=True, kw_only=True):
    """What decode rank `rank` of a TP x DCP instance holds and computes."""

    rank: int
    tp_size: int
    dcp_size: int
    group: int
    """Head group: rank // dcp_size."""
    dcp_rank: int
    """Position in the group: rank % dcp_size; the rank holds tokens t ≡ dcp_rank."""
    kv_head_start: int
    kv_head_end: int
    """KV heads of the model in this rank's cache (its group's)."""
    group_q_start: int
    group_q_end: int
    """Query heads of the group: the rank projects q for these and attends with them."""
    q_head_start: int
    q_head_end: int
    """Query heads whose merged attention output this rank owns (its o_proj columns)."""

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start

    @property
    def num_group_q_heads(self) -> int:
        return self.group_q_end - self.group_q_start


def head_layout_error(num_heads: int, num_kv_heads: int, tp: int, dcp: int) -> str | None:
    """Why TP x DCP cannot hold a model with these heads, or None."""
    if tp % dcp:
        return f"decode_context_parallel {dcp} does not divide tensor_parallel {tp}"
    groups = tp // dcp
    if groups <= num_kv_heads and num_kv_heads % groups == 0:
        return None
    if groups > num_kv_heads and groups % num_kv_heads == 0 and num_heads % groups == 0:
        return None
    valid = sorted(
        {g for g in range(1, max(num_kv_heads, num_heads) + 1) if num_kv_heads % g == 0}
        | {
            g
            for g in range(num_kv_heads + 1, num_heads + 1)
            if g % num_kv_heads == 0 and num_heads % g == 0
        }
    )
    return (
        f"tensor_parallel {tp} / decode_context_parallel {dcp} = {groups} KV-head groups "
        f"cannot share the model's {num_kv_heads} KV heads ({num_heads} query heads); "
        f"tensor_parallel / decode_context_parallel must be one of {valid}"
    )


def decode_rank_shards(
    num_heads: int, num_kv_heads: int, tp: int, dcp: int
) -> list[DecodeRankShard]:
    """The shard of every rank (see the module docstring); ValueError if it cannot split."""
    problem = head_layout_error(num_heads, num_kv_heads, tp, dcp)
    if problem is not None:
        raise ValueError(problem)
    groups = tp // dcp
    out = []
    for rank in range(tp):
        g, d = divmod(rank, dcp)
        if groups <= num_kv_heads:
            kv0, kv1 = split_range(num_kv_heads, groups, g)
        else:
            kv0 = g // (groups // num_kv_heads)
            kv1 = kv0 + 1
        q0, q1 = split_range(num_heads, groups, g)
        o0, o1 = split_range(q1 - q0, dcp, d)
        out.append(
            DecodeRankShard(
                rank=rank,
                tp_size=tp,
                dcp_size=dcp,
                group=g,
                dcp_rank=d,
                kv_head_start=kv0,
                kv_head_end=kv1,
                group_q_start=q0,
                group_q_end=q1,
                q_head_start=q0 + o0,
                q_head_end=q0 + o1,
            )
        )
    return out


LANDING_REGION_SHARE = 4
"""A request's landing region is at most 1/LANDING_REGION_SHARE of a decode rank's landing
buffer (transfer/landing.py): that many long prompts stream at once."""


def landing_region_max(landing_bytes: int, region_bytes: int | None = None) -> int:
    """The largest landing region a request gets (4 KiB pages): `region_bytes` (a decode
    instance's `landing_region`, checked to fit the buffer), else 1/LANDING_REGION_SHARE
    of the buffer."""
    cap = landing_bytes // LANDING_REGION_SHARE if region_bytes is None else region_bytes
    return max(4096, min(cap, landing_bytes) // 4096 * 4096)


def landing_error(
    landing_bytes: int,
    rank_bytes_per_token: int,
    num_stages: int,
    max_context: int,
    region_bytes: int | None = None,
) -> str | None:
    """Why a decode rank's landing buffer cannot stream prompts up to `max_context`
    tokens, or None: every prefill stage's share of a region must hold two tokens of its
    layers (transfer/ring.py), whatever the context length."""
    region = landing_region_max(landing_bytes, region_bytes)
    need = 2 * rank_bytes_per_token + 256 * (num_stages + 1)
    if region >= need:
        return None
    if region_bytes is not None:
        return (
            f"landing_region gives a request a landing region of {region} bytes; streaming "
            f"a {max_context}-token context to this rank needs at least {need} (two tokens "
            f"of KV of every layer): raise landing_region (and landing_memory) to at least that"
        )
    return (
        f"{landing_bytes} bytes give a request a landing region of {region} bytes; "
        f"streaming a {max_context}-token context to this rank needs at least {need} "
        f"(two tokens of KV of every layer); raise it to at least "
        f"{need * LANDING_REGION_SHARE} bytes"
    )

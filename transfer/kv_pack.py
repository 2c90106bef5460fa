"""Pack KV of a token range out of the paged cache into a contiguous segment, and back.

Paged cache (engine), one tensor per layer; token t sits at slot s(t):

    kv[l]: [P, num_blocks, block_size, Hkv, D]  --view-->  [P, num_blocks*block_size, Hkv, D]
    s(t) = block_table[t // block_size] * block_size + t % block_size

P (protocol/kv_layout.py) is 2 (K, V) for an mha cache, 1 (the latent) for an mla one.

Packed segment (staging and landing buffers), the wire format of protocol.KVSegment:

    [L, P, n, h, D]: P*L rows, row r = (layer r // P, part r % P: K then V, or the
    latent), each row the n selected tokens in order, each token h heads x D values. A run
    of whole rows, or a token sub-range of one row, is contiguous; HandoffSender splits
    along exactly those. An mla cache has one head: every DCP rank gets heads [0, 1).

KVShard picks the part a decode rank owns (DESIGN §6): heads [head_start, head_end) and
the DCP stripe t ≡ dcp_rank (mod dcp_size). Defaults: all heads, every token.

    tokens            start=3                                end=10
                      |  t3   t4   t5   t6   t7   t8   t9  |
    dcp_size=2, r=1:     t3        t5        t7        t9      n = 4 selected
    gather reads the FULL cache at s(t), heads [h0, h1)
    scatter writes the rank-LOCAL cache at local position p = t // dcp_size:
        t3 -> p1   t5 -> p2   t7 -> p3   t9 -> p4      slot = block_table[p // bs]*bs + p % bs

With the default shard scatter is the exact inverse of gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.kv_layout import KVLayout
from transfer.errors import PackLayoutError


@dataclass(frozen=True)
class KVShard:
    """Which heads and which tokens (DCP stripe) of the KV one flow carries."""

    head_start: int = 0
    head_end: int | None = None
    """Exclusive; None = all heads of the source cache."""
    dcp_size: int = 1
    dcp_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.dcp_rank < self.dcp_size:
            raise PackLayoutError(f"KVShard: need 0 <= dcp_rank < dcp_size, got {self}")
        if self.head_start < 0 or (self.head_end is not None and self.head_end <= self.head_start):
            raise PackLayoutError(f"KVShard: empty or negative head range in {self}")

    def heads(self, num_kv_heads: int) -> tuple[int, int]:
        end = num_kv_heads if self.head_end is None else self.head_end
        if end > num_kv_heads:
            raise PackLayoutError(f"KVShard heads end {end} > the cache's {num_kv_heads} heads")
        return self.head_start, end

    def tokens(self, token_start: int, token_end: int) -> torch.Tensor:
        """The selected token positions of [token_start, token_end), ascending."""
        first = token_start + (self.dcp_rank - token_start) % self.dcp_size
        return torch.arange(first, max(first, token_end), self.dcp_size, dtype=torch.long)

    def num_tokens(self, token_start: int, token_end: int) -> int:
        first = token_start + (self.dcp_rank - token_start) % self.dcp_size
        return max(0, -(-(token_end - first) // self.dcp_size))


FULL = KVShard()


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """Element type of the layout's caches and packed segments (uint8 for fp8 rows)."""
    dtype = getattr(torch, layout.storage_dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def packed_nbytes(layout: KVLayout, num_tokens: int) -> int:
    """Bytes of a packed segment of `num_tokens` tokens of `layout` (all its heads)."""
    return num_tokens * layout.bytes_per_token


def packed_view(
    buffer: torch.Tensor, offset_bytes: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A `dtype` tensor of `shape` over buffer[offset_bytes:] (a flat uint8 tensor)."""
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise PackLayoutError("packed_view needs a flat uint8 buffer")
    if offset_bytes < 0 or offset_bytes + nbytes > buffer.numel():
        raise PackLayoutError(
            f"segment [{offset_bytes}, +{nbytes}) does not fit a {buffer.numel()}-byte buffer"
        )
    if offset_bytes % dtype.itemsize:
        raise PackLayoutError(f"offset {offset_bytes} is not aligned to {dtype}")
    return buffer[offset_bytes : offset_bytes + nbytes].view(dtype).view(shape)


def cache_geometry(kv_caches: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, Hkv, D) of a valid list of per-layer paged caches (the
    parts P are kv_caches[0].shape[0])."""
    if not kv_caches:
        raise PackLayoutError("kv_caches is empty")
    shape = kv_caches[0].shape
    if len(shape) != 5 or shape[0] not in (1, 2):
        raise PackLayoutError(
            f"a layer cache must be [P (1 or 2), blocks, bs, Hkv, D], got {shape}"
        )
    for kv in kv_caches:
        if kv.shape != shape or kv.dtype != kv_caches[0].dtype or not kv.is_contiguous():
            raise PackLayoutError("every layer cache needs the same shape/dtype, contiguous")
    return shape[1], shape[2], shape[3], shape[4]


def slots_for(
    block_table: list[int], block_size: int, positions: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """s(p) for each position p (diagram above), as a long tensor on `device`."""
    if positions.numel() and int(positions[-1]) // block_size >= len(block_table):
        raise PackLayoutError(
            f"position {int(positions[-1])} is beyond the block table "
            f"({len(block_table)} blocks of {block_size})"
        )
    table = torch.tensor(block_table, dtype=torch.long)
    slots = table[positions // block_size] * block_size + positions % block_size
    return slots.to(device)


def gather_rows(
    kv_caches: list[torch.Tensor],
    slots: torch.Tensor,
    heads: tuple[int, int],
    row_start: int,
    out: torch.Tensor,
) -> None:
    """out[i] = row (row_start + i) at `slots`, heads [h0, h1): out is [rows, n, h, D]."""
    h0, h1 = heads
    parts = kv_caches[0].shape[0]
    for i in range(out.shape[0]):
        layer, kv = divmod(row_start + i, parts)
        src = kv_caches[layer][kv].flatten(0, 1)[:, h0:h1]  # [blocks*bs, h, D]
        torch.index_select(src, 0, slots, out=out[i])


def scatter_rows(
    src: torch.Tensor, kv_caches: list[torch.Tensor], slots: torch.Tensor, row_start: int
) -> None:
    """Row (row_start + i) at `slots` = src[i], all heads: src is [rows, n, Hkv, D]."""
    parts = kv_caches[0].shape[0]
    for i in range(src.shape[0]):
        layer, kv = divmod(row_start + i, parts)
        kv_caches[layer][kv].flatten(0, 1).index_copy_(0, slots, src[i])


def gather(
    kv_caches: list[torch.Tensor],
    block_table: list[int],
    token_start: int,
    token_end: int,
    out: torch.Tensor,
    shard: KVShard = FULL,
) -> None:
    """Pack tokens [token_start, token_end) of every layer (shard's heads and stripe) from
    the full paged cache into `out`, a contiguous [L, P, n, h, D] tensor (e.g. a
    packed_view of a staging buffer). Reads kv_caches, mutates only out."""
    _, bs, num_heads, head_dim = cache_geometry(kv_caches)
    parts = kv_caches[0].shape[0]
    h0, h1 = shard.heads(num_heads)
    n = shard.num_tokens(token_start, token_end)
    want = (len(kv_caches), parts, n, h1 - h0, head_dim)
    if tuple(out.shape) != want or out.dtype != kv_caches[0].dtype or not out.is_contiguous():
        raise PackLayoutError(f"gather out must be contiguous {want} {kv_caches[0].dtype}")
    slots = slots_for(block_table, bs, shard.tokens(token_start, token_end), out.device)
    rows = out.view(parts * len(kv_caches), n, h1 - h0, head_dim)
    gather_rows(kv_caches, slots, (h0, h1), 0, rows)


def local_positions(token_start: int, token_end: int, shard: KVShard) -> torch.Tensor:
    """Where the shard's tokens sit in the rank-local cache: t // dcp_size."""
    return shard.tokens(token_start, token_end) // shard.dcp_size


def scatter(
    src: torch.Tensor,
    kv_caches: list[torch.Tensor],
    block_table: list[int],
    token_start: int,
    token_end: int,
    shard: KVShard = FULL,
) -> None:
    """Inverse of gather: unpack a [L, P, n, Hkv, D] segment of tokens [token_start,
    token_end) (the shard's stripe) into the rank-local paged cache, whose heads are all
    the shard's heads and whose block_table is over local positions t // dcp_size.
    Mutates kv_caches at those slots only."""
    _, bs, num_heads, head_dim = cache_geometry(kv_caches)
    parts = kv_caches[0].shape[0]
    n = shard.num_tokens(token_start, token_end)
    want = (len(kv_caches), parts, n, num_heads, head_dim)
    if tuple(src.shape) != want or src.dtype != kv_caches[0].dtype:
        raise PackLayoutError(f"scatter src must be {want} {kv_caches[0].dtype}, got {src.shape}")
    positions = local_positions(token_start, token_end, shard)
    slots = slots_for(block_table, bs, positions, kv_caches[0].device)
    rows = src.reshape(parts * len(kv_caches), n, num_heads, head_dim)
    scatter_rows(rows, kv_caches, slots, 0)

"""Whole blocks of a paged KV cache to and from one pool object's payload.

kv[l]: [P, num_blocks, bs, H, D] --index_select(dim 1, block_ids)--> payload[l] viewed
                                                                  [P, nblk, bs, H, D]
(P = 2 for K and V, 1 for an MLA latent; protocol/kv_layout.py)
"""

from __future__ import annotations

import torch

from kvpool.object_format import payload_checksum_t
from protocol.ids import BlockId


def pack_blocks(
    layers: list[torch.Tensor], block_ids: list[BlockId], out: torch.Tensor
) -> int | None:
    """Copy whole blocks of `layers` into `out`, a contiguous [L, P, n, H, D] payload with
    n = len(block_ids) * block_size (token t of it = block block_ids[t // bs], offset
    t % bs): one index_select per layer, through a device temporary for a GPU cache.
    Returns the payload checksum (payload_checksum_t) computed on the device before the
    D2H copy for a device cache; None for a host cache (the save thread's write_header
    computes it there, off the engine thread).

        kv[l]: [P, num_blocks, bs, H, D] --index_select(dim 1, block_ids)--> out[l] viewed
                                                                          [P, nblk, bs, H, D]
    """
    dev = layers[0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    dst = out if out.device == dev else torch.empty(out.shape, dtype=out.dtype, device=dev)
    parts, _, bs, h, d = layers[0].shape
    for layer, kv in enumerate(layers):
        torch.index_select(kv, 1, idx, out=dst[layer].view(parts, len(block_ids), bs, h, d))
    if dst is out:
        return None
    checksum = payload_checksum_t(dst.view(-1).view(torch.uint8))
    out.copy_(dst)
    return checksum


def unpack_blocks(src: torch.Tensor, layers: list[torch.Tensor], block_ids: list[BlockId]) -> None:
    """Inverse of pack_blocks: src [L, P, len(block_ids) * bs, H, D] into those blocks."""
    dev = layers[0].device
    if src.device != dev:
        src = src.to(dev, non_blocking=True)
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    parts, _, bs, h, d = layers[0].shape
    for layer, kv in enumerate(layers):
        kv.index_copy_(1, idx, src[layer].reshape(parts, len(block_ids), bs, h, d))

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


def unpack_chunks(src: torch.Tensor, layers: list[torch.Tensor], block_ids: list[BlockId]) -> None:
    """Whole chunks at once: src [G, L, P, n, H, D] (G payloads, each as pack_blocks wrote
    it; any strides between payloads) into block_ids, chunk-major (G * n / bs blocks: chunk
    g's payload fills block_ids[g * n/bs : (g + 1) * n/bs]). One index_put per layer for the
    whole group instead of one index_copy_ per layer and chunk: a GPU restore of an 8B
    model unpacks 8 chunks in 32 launches, not 256.

        src[:, l] viewed [G, P, nblk, bs, H, D] --transpose--> [P, G, nblk, bs, H, D]
                                                  --> kv[l][:, ids.view(G, nblk)]
    """
    dev = layers[0].device
    num_chunks, _, parts, n, h, d = src.shape
    bs = layers[0].shape[2]
    nblk = n // bs
    assert len(block_ids) == num_chunks * nblk
    if src.device != dev:
        src = src.to(dev, non_blocking=True)
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev).view(num_chunks, nblk)
    for layer, kv in enumerate(layers):
        part = src[:, layer].reshape(num_chunks, parts, nblk, bs, h, d).transpose(0, 1)
        kv[:, idx] = part

"""The KV namespace: everything that changes the bytes of KV for a given token prefix.

Two deployments whose namespaces differ never read each other's KV (prefix cache or pool):
the namespace seeds the hash chain (protocol/hashing.py).
"""

from __future__ import annotations

import msgspec

KV_FORMAT_VERSION = 1


class KVNamespace(msgspec.Struct, frozen=True, kw_only=True):
    """Identity of KV bytes: weights, KV dtype, block/chunk size, layer split, RoPE."""

    weights_fingerprint: str
    kv_dtype: str
    block_size: int
    chunk_size: int = 256
    layer_split: tuple[int, ...]
    """Layers per prefill pipeline stage, e.g. (20, 20, 20, 18); (L,) without PP."""
    rope: str
    """RoPE settings as a canonical string (theta and scaling)."""
    format_version: int = KV_FORMAT_VERSION

    def key(self) -> str:
        """Canonical string form, the input of protocol.hashing.namespace_seed."""
        split = "-".join(str(n) for n in self.layer_split)
        return (
            f"kvserve/v{self.format_version}|w={self.weights_fingerprint}|dt={self.kv_dtype}"
            f"|bs={self.block_size}|cs={self.chunk_size}|pp={split}|rope={self.rope}"
        )

"""Description of how an instance stores KV, shared by engine, pool and handoff.

The engine's paged cache for one layer is a tensor

    kv[layer]: [P, num_blocks, block_size, num_kv_heads, head_dim]

whose leading dim P (`num_parts`) depends on the KV kind:

    kind "mha" (multi-head / grouped-query attention): P = 2, part 0 = K, part 1 = V,
        num_kv_heads x head_dim each;
    kind "mla" (multi-head latent attention, DeepSeek-V2/V3): P = 1, one "head"
        (num_kv_heads = 1) of head_dim = kv_lora_rank + qk_rope_head_dim: the compressed
        latent followed by the rotated shared key part, read by every query head.

so the KV of token t of a request lives at
    block_id = block_table[t // block_size], offset = t % block_size,
    slot = block_id * block_size + offset,
and one token of one layer is num_parts x num_kv_heads x head_dim elements of `dtype`
(bytes_per_token_per_layer = f(kind, dtype)). Every packed format (pool objects, handoff
segments) is a sequence of such rows, `num_parts` per layer.
"""

from __future__ import annotations

import msgspec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

KV_KIND_PARTS = {"mha": 2, "mla": 1}
"""Cache parts per layer of each KV kind (see the module docstring)."""


def kv_kind_parts(kind: str) -> int:
    """Parts of a layer's cache for `kind`; ValueError naming the kinds if unknown."""
    if kind not in KV_KIND_PARTS:
        raise ValueError(f"unknown KV kind {kind!r}; valid: {sorted(KV_KIND_PARTS)}")
    return KV_KIND_PARTS[kind]


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of the paged KV cache of one instance (or one stage/rank of it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    """Element type name as torch spells it without the prefix: float32, bfloat16, ..."""
    kind: str = "mha"
    """"mha" (K and V) or "mla" (one latent entry, num_kv_heads 1); see the module doc."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; valid: {sorted(DTYPE_BYTES)}")
        kv_kind_parts(self.kind)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError("an mla KVLayout holds one latent head (num_kv_heads 1)")

    @property
    def num_parts(self) -> int:
        """Leading dim of a layer's cache: 2 (K, V) for mha, 1 (the latent) for mla."""
        return KV_KIND_PARTS[self.kind]

    @property
    def bytes_per_token_per_layer(self) -> int:
        """All parts (K and V, or the latent) of one token in one layer."""
        return self.num_parts * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged cache of `num_blocks` blocks."""
        return (self.num_parts, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

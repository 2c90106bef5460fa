"""Description of how an instance stores KV, shared by engine, pool and handoff.

The engine's paged cache for one layer is a tensor

    kv[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
                ^ 0 = K, 1 = V

so the KV of token t of a request lives at
    block_id = block_table[t // block_size], offset = t % block_size,
    slot = block_id * block_size + offset.
"""

from __future__ import annotations

import msgspec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of the paged KV cache of one instance (or one stage/rank of it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    """Element type name as torch spells it without the prefix: float32, bfloat16, ..."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; valid: {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

"""Description of how an instance stores KV, shared by engine, pool and handoff.

The engine's paged cache for one layer is a tensor

    kv[layer]: [2, num_blocks, block_size, num_kv_heads, row_width]  of storage_dtype
                ^ 0 = K, 1 = V

so the KV of token t of a request lives at
    block_id = block_table[t // block_size], offset = t % block_size,
    slot = block_id * block_size + offset.

One head row (one token, K or V, one KV head) depends on the KV cache dtype:

    "auto":      head_dim values of the model dtype              (row_width = head_dim)
    "fp8_e4m3":  head_dim float8 e4m3 bytes | float32 scale (4 B), stored as uint8
                 (row_width = head_dim + 4); the value is fp8 * scale, the scale the row's
                 absolute maximum / 448 (engine/attention/kv_quant.py)

Keeping the scale inside its row means every byte mover (pool objects, handoff pieces,
TP head seams, DCP token stripes) carries the scales with their values without knowing
the format: restored KV is the computed bytes.
"""

from __future__ import annotations

import msgspec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""KV cache element formats: "auto" stores the model dtype."""

FP8_SCALE_BYTES = 4
"""Bytes of the float32 scale that ends every fp8_e4m3 head row."""


def row_bytes(cache_dtype: str, dtype: str, row_elems: int) -> int:
    """Bytes of one stored row of `row_elems` values (a K or V head row) of a model in
    `dtype` whose KV cache dtype is `cache_dtype`; the one rule the engine, budgets and
    cluster checks share."""
    if cache_dtype == "fp8_e4m3":
        return row_elems + FP8_SCALE_BYTES
    return row_elems * DTYPE_BYTES[dtype]


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of the paged KV cache of one instance (or one stage/rank of it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    """Model (activation) element type as torch spells it without the prefix: float32,
    bfloat16, ...; the KV element type when cache_dtype is "auto"."""
    cache_dtype: str = "auto"
    """KV cache format: "auto" (the model dtype) or "fp8_e4m3" (rows with scales)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; valid: {sorted(DTYPE_BYTES)}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {self.cache_dtype!r}; valid: {list(KV_CACHE_DTYPES)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")

    @property
    def storage_dtype(self) -> str:
        """Element type of the cache tensors and packed segments (torch name)."""
        return "uint8" if self.cache_dtype == "fp8_e4m3" else self.dtype

    @property
    def row_bytes(self) -> int:
        """One head row of K or V of one token, scale included."""
        return row_bytes(self.cache_dtype, self.dtype, self.head_dim)

    @property
    def row_width(self) -> int:
        """Elements of storage_dtype per head row: the last dim of cache and segments."""
        return self.row_bytes // DTYPE_BYTES[self.storage_dtype]

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged cache of `num_blocks` blocks."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

"""Description of how an instance stores KV, shared by engine, pool and handoff.

The engine's paged cache for one layer is a tensor

    kv[layer]: [P, num_blocks, block_size, num_kv_heads, row_width]  of storage_dtype

whose leading dim P (`num_parts`) depends on the KV kind:

    kind "mha" (multi-head / grouped-query attention): P = 2, part 0 = K, part 1 = V,
        num_kv_heads rows of head_dim values each;
    kind "mla" (multi-head latent attention, DeepSeek-V2/V3): P = 1, one "head"
        (num_kv_heads = 1) of head_dim = kv_lora_rank + qk_rope_head_dim: the compressed
        latent followed by the rotated shared key part, read by every query head.

and whose rows (one token, one part, one head) depend on the KV cache dtype:

    "auto":      head_dim values of the model dtype              (row_width = head_dim)
    "fp8_e4m3":  head_dim float8 e4m3 bytes | float32 scale (4 B), stored as uint8
                 (row_width = head_dim + 4); the value is fp8 * scale, the scale the row's
                 absolute maximum × (1/448) (engine/attention/kv_quant.py)

so the KV of token t of a request lives at
    block_id = block_table[t // block_size], offset = t % block_size,
    slot = block_id * block_size + offset,
and one token of one layer is num_parts x num_kv_heads rows (bytes_per_token_per_layer =
f(kind, cache dtype)). Every packed format (pool objects, handoff segments) is a sequence
of such rows, `num_parts` per layer. Keeping the scale inside its row means every byte
mover (pool objects, handoff pieces, TP head seams, DCP token stripes) carries the scales
with their values without knowing the format: restored KV is the computed bytes.
"""

from __future__ import annotations

import msgspec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}

KV_KIND_PARTS = {"mha": 2, "mla": 1}
"""Cache parts per layer of each KV kind (see the module docstring)."""

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""KV cache element formats: "auto" stores the model dtype."""

FP8_SCALE_BYTES = 4
"""Bytes of the float32 scale that ends every fp8_e4m3 row."""


def kv_kind_parts(kind: str) -> int:
    """Parts of a layer's cache for `kind`; ValueError naming the kinds if unknown."""
    if kind not in KV_KIND_PARTS:
        raise ValueError(f"unknown KV kind {kind!r}; valid: {sorted(KV_KIND_PARTS)}")
    return KV_KIND_PARTS[kind]


def row_bytes(cache_dtype: str, dtype: str, row_elems: int) -> int:
    """Bytes of one stored row of `row_elems` values (a K or V head row, or an MLA latent
    entry) of a model in `dtype` whose KV cache dtype is `cache_dtype`; the one rule the
    engine, budgets and cluster checks share."""
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
    kind: str = "mha"
    """"mha" (K and V) or "mla" (one latent entry, num_kv_heads 1); see the module doc."""
    cache_dtype: str = "auto"
    """KV cache format: "auto" (the model dtype) or "fp8_e4m3" (rows with scales)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; valid: {sorted(DTYPE_BYTES)}")
        kv_kind_parts(self.kind)
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {self.cache_dtype!r}; valid: {list(KV_CACHE_DTYPES)}"
            )
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
    def storage_dtype(self) -> str:
        """Element type of the cache tensors and packed segments (torch name)."""
        return "uint8" if self.cache_dtype == "fp8_e4m3" else self.dtype

    @property
    def row_bytes(self) -> int:
        """One row (a part of one head of one token), scale included."""
        return row_bytes(self.cache_dtype, self.dtype, self.head_dim)

    @property
    def row_width(self) -> int:
        """Elements of storage_dtype per row: the last dim of caches and segments."""
        return self.row_bytes // DTYPE_BYTES[self.storage_dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        """All parts (K and V, or the latent) of one token in one layer."""
        return self.num_parts * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged cache of `num_blocks` blocks."""
        return (self.num_parts, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

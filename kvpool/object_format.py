"""The pool object: one (256-token chunk, prefill stage), header + packed KV payload.

    offset 0                                   128                         128 + payload
    | header (HEADER_BYTES, little endian)     | payload: [L_s, 2, n, H, D] of dtype |

    header: magic "KVSP" | format version | header size | namespace hash (16 B)
            | chunk key (16 B) | stage | number of stages | layer range [start, end)
            | token count n | dtype code | shape (5 x u32) | payload bytes
            | payload checksum (xxh3_64) | header checksum (xxh3_64 of the bytes before it)

The payload is transfer/kv_pack's packed segment for the stage's layers: 2*L_s rows
(layer, K|V), each the chunk's n tokens of H heads x D values. A reader knows exactly
what it expects (`ObjectSpec`): any difference in size, header or checksum makes the
object unusable (a miss that the caller counts and removes), never partly used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from protocol.ids import ChunkKey
from protocol.kv_layout import DTYPE_BYTES

MAGIC = b"KVSP"
FORMAT_VERSION = 1
HEADER_BYTES = 128
_HEADER = struct.Struct("<4sHH16s16sHHHHIB3x5IQQ")
_HEADER_CHECK = struct.Struct("<Q")
_USED = _HEADER.size + _HEADER_CHECK.size
assert _USED <= HEADER_BYTES
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4}
assert set(DTYPE_CODES) == set(DTYPE_BYTES)


@dataclass(frozen=True)
class ObjectSpec:
    """What one stage's object of any chunk must look like (everything but the key)."""

    namespace_hash: bytes
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    num_tokens: int
    dtype: str
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[L_s, 2, n, H, D] of the payload."""
        return (
            self.layer_end - self.layer_start,
            2,
            self.num_tokens,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def payload_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def payload_checksum(obj: np.ndarray, spec: ObjectSpec) -> int:
    """xxh3_64 of the payload of an object held in `obj` (a flat uint8 array)."""
    return xxhash.xxh3_64_intdigest(obj[HEADER_BYTES : spec.object_bytes].data)


def write_header(obj: np.ndarray, spec: ObjectSpec, chunk_key: ChunkKey) -> None:
    """Seal an object whose payload is already in obj[HEADER_BYTES:]: write its header,
    with the payload checksum. `obj` is a flat uint8 array of at least object_bytes."""
    head = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        spec.namespace_hash,
        bytes(chunk_key),
        spec.stage,
        spec.num_stages,
        spec.layer_start,
        spec.layer_end,
        spec.num_tokens,
        DTYPE_CODES[spec.dtype],
        *spec.shape,
        spec.payload_bytes,
        payload_checksum(obj, spec),
    )
    head += _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(head))
    obj[:HEADER_BYTES] = 0
    obj[: len(head)] = np.frombuffer(head, dtype=np.uint8)


def check_object(obj: np.ndarray, nbytes: int, spec: ObjectSpec, chunk_key: ChunkKey) -> str | None:
    """None when obj[:nbytes] is exactly the object `spec` expects for `chunk_key`;
    otherwise the first thing that differs: "size", "header" (magic, version, header
    checksum), "namespace", "chunk_key", "layout" (stage, layers, tokens, dtype, shape)
    or "checksum" (payload)."""
    if nbytes != spec.object_bytes:
        return "size"
    head = obj[:_USED].tobytes()
    fields = _HEADER.unpack(head[: _HEADER.size])
    (check,) = _HEADER_CHECK.unpack(head[_HEADER.size :])
    magic, version, header_bytes = fields[:3]
    if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        return "header"
    if check != xxhash.xxh3_64_intdigest(head[: _HEADER.size]):
        return "header"
    if fields[3] != spec.namespace_hash:
        return "namespace"
    if fields[4] != bytes(chunk_key):
        return "chunk_key"
    want = (
        spec.stage,
        spec.num_stages,
        spec.layer_start,
        spec.layer_end,
        spec.num_tokens,
        DTYPE_CODES[spec.dtype],
        *spec.shape,
        spec.payload_bytes,
    )
    if tuple(fields[5:-1]) != want:
        return "layout"
    if fields[-1] != payload_checksum(obj, spec):
        return "checksum"
    return None

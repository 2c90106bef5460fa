"""The pool object: one (256-token chunk, prefill stage), header + packed KV payload.

    offset 0                                   128                         128 + payload
    | header (HEADER_BYTES, little endian)     | payload: [L_s, P, n, H, D] of dtype |

    header: magic "KVSP" | format version | header size | namespace hash (16 B)
            | chunk key (16 B) | stage | number of stages | layer range [start, end)
            | token count n | dtype code | shape (5 x u32) | payload bytes
            | payload checksum (payload_checksum_t) | header checksum (xxh3_64 of the bytes
            before it)

The payload is transfer/kv_pack's packed segment for the stage's layers: 2*L_s rows
(layer, K|V), each the chunk's n tokens of H heads x D values. A reader knows exactly
what it expects (`ObjectSpec`): any difference in size, header or checksum makes the
object unusable (a miss that the caller counts and removes), never partly used.

Format 2: the payload checksum is a torch function (`payload_checksum_t`) that the device
holding the payload computes at memory speed (a GPU verifies after its H2D copy, a CPU
engine on the host): over the payload viewed as int32 words w_i (sign-extended to int64),

    s1 = sum(w_i),  s2 = sum(w_i * m_i)  (mod 2^64),  m_i = 2 * ((i * K) mod 2^31) + 1

and the stored value is xxh3_64 of (s1, s2) as two little-endian int64. Wraparound sums are
order-independent, so CPU and CUDA agree bit for bit. s1 catches any single-word change
(a bit flip changes it by +-2^k); s2 catches swapped words (m_i differ mod 2^32, and
words differ by less than 2^33, so (w_i - w_j)(m_i - m_j) != 0 mod 2^64) and most
zeroed ranges. It is an integrity check against corruption, not a cryptographic hash.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from protocol.ids import ChunkKey
from protocol.kv_layout import DTYPE_BYTES

MAGIC = b"KVSP"
FORMAT_VERSION = 2
HEADER_BYTES = 128
_HEADER = struct.Struct("<4sHH16s16sHHHHIB3x5IQQ")
_HEADER_CHECK = struct.Struct("<Q")
_USED = _HEADER.size + _HEADER_CHECK.size
assert _USED <= HEADER_BYTES
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "uint8": 5}
"""uint8: fp8_e4m3 KV rows with their scales (protocol/kv_layout.py); the namespace hash
in the header tells the KV cache dtypes apart."""
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
    """D: elements of `dtype` per head row (the layout's row_width: head_dim + 4 for fp8
    rows with their scales)."""
    num_parts: int = 2
    """Cache parts per layer (protocol/kv_layout.py): 2 (K, V) or 1 (an MLA latent)."""

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[L_s, P, n, H, D] of the payload (P = num_parts; the header stores it)."""
        return (
            self.layer_end - self.layer_start,
            self.num_parts,
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


_MULT_K = 0x9E3779B1  # odd: i -> i * K mod 2^31 is a bijection
_MULT_CACHE: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()
_MULT_CACHE_SIZE = 8
_MULT_LOCK = threading.Lock()


def _multipliers(num_words: int, device: torch.device) -> torch.Tensor:
    """m_i = 2 * ((i * K) mod 2^31) + 1 for i < num_words, int64 (cached per (length, device))."""
    key = (num_words, str(device))
    with _MULT_LOCK:
        m = _MULT_CACHE.get(key)
        if m is not None:
            _MULT_CACHE.move_to_end(key)
            return m
    m = torch.arange(num_words, dtype=torch.int64, device=device)
    m = ((m * _MULT_K) & 0x7FFFFFFF) * 2 + 1
    with _MULT_LOCK:
        _MULT_CACHE[key] = m
        while len(_MULT_CACHE) > _MULT_CACHE_SIZE:
            _MULT_CACHE.popitem(last=False)
    return m


def payload_sums_t(payloads_u8: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of each payload: `payloads_u8` is [..., nbytes] uint8 (any device; the
    last dim is the payload), the result [..., 2] int64 on the same device. Asynchronous
    on CUDA (no host sync): several payloads of one size are checked in one pass."""
    assert payloads_u8.dtype == torch.uint8
    x = payloads_u8.contiguous()
    nbytes = x.shape[-1]
    if nbytes % 4:
        x = torch.nn.functional.pad(x, (0, 4 - nbytes % 4))
    if x.device.type == "cpu":
        return _host_sums(x.view(torch.int32))
    w = x.view(torch.int32).to(torch.int64)
    m = _multipliers(w.shape[-1], w.device)
    s1 = w.sum(-1)
    w.mul_(m)
    s2 = w.sum(-1)
    return torch.stack((s1, s2), -1)


_HOST_BLOCK_WORDS = 1 << 19
"""Words per cache-sized step on the host (~5x faster there than one pass over a
payload's int64 copy); the sums are the same, wraparound addition being associative."""


def _host_sums(words: torch.Tensor) -> torch.Tensor:
    rows = words.reshape(-1, words.shape[-1])
    n = rows.shape[1]
    m = _multipliers(n, words.device)
    buf = torch.empty(min(n, _HOST_BLOCK_WORDS), dtype=torch.int64)
    out = torch.zeros(rows.shape[0], 2, dtype=torch.int64)
    for r in range(rows.shape[0]):
        for i in range(0, n, _HOST_BLOCK_WORDS):
            w = buf[: min(_HOST_BLOCK_WORDS, n - i)]
            w.copy_(rows[r, i : i + _HOST_BLOCK_WORDS])
            out[r, 0] += w.sum()
            w.mul_(m[i : i + _HOST_BLOCK_WORDS])
            out[r, 1] += w.sum()
    return out.reshape(*words.shape[:-1], 2)


def checksum_of_sums(s1: int, s2: int) -> int:
    """The stored 64-bit payload checksum of a payload's (s1, s2) (payload_sums_t)."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qq", s1, s2))


def checksums_of_sums(sums: torch.Tensor) -> list[int]:
    """Stored checksums of a [n, 2] payload_sums_t result (one host sync)."""
    return [checksum_of_sums(a, b) for a, b in sums.reshape(-1, 2).tolist()]


def payload_checksum_t(payload_u8: torch.Tensor) -> int:
    """The payload checksum of one payload (a uint8 tensor on any device; flattened),
    computed where it lives; CPU and CUDA give the same value."""
    s1, s2 = payload_sums_t(payload_u8.reshape(-1)).tolist()
    return checksum_of_sums(s1, s2)


def payload_checksum(obj: np.ndarray, spec: ObjectSpec) -> int:
    """The payload checksum of an object held in `obj` (a flat uint8 array), on the host."""
    return payload_checksum_t(torch.from_numpy(obj[HEADER_BYTES : spec.object_bytes]))


def write_header(
    obj: np.ndarray, spec: ObjectSpec, chunk_key: ChunkKey, checksum: int | None = None
) -> None:
    """Seal an object whose payload is already in obj[HEADER_BYTES:]: write its header,
    with the payload checksum: `checksum` when the caller computed it where the payload
    was packed (payload_checksum_t on the device), else computed here on the host. `obj`
    is a flat uint8 array of at least object_bytes."""
    if checksum is None:
        checksum = payload_checksum(obj, spec)
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
        checksum,
    )
    head += _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(head))
    obj[:HEADER_BYTES] = 0
    obj[: len(head)] = np.frombuffer(head, dtype=np.uint8)


def stored_payload_checksum(obj: np.ndarray) -> int:
    """The payload checksum stored in the header of `obj` (meaningful once check_object
    accepted the header)."""
    return int(_HEADER.unpack(obj[: _HEADER.size].tobytes())[-1])


def check_object(
    obj: np.ndarray,
    nbytes: int,
    spec: ObjectSpec,
    chunk_key: ChunkKey,
    verify_payload: bool = True,
) -> str | None:
    """None when obj[:nbytes] is exactly the object `spec` expects for `chunk_key`;
    otherwise the first thing that differs: "size", "header" (magic, version, header
    checksum), "namespace", "chunk_key", "layout" (stage, layers, tokens, dtype, shape)
    or "checksum" (payload). With verify_payload=False the payload checksum is left to
    the caller (stored_payload_checksum vs payload_checksum_t where the payload goes)."""
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
    if verify_payload and fields[-1] != payload_checksum(obj, spec):
        return "checksum"
    return None

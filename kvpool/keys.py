"""Pool keys, group ids and stage layer ranges.

    object key  kvserve/<namespace hash>/<chunk key>/s<stage>of<num stages>
    group id    kvserve/<namespace hash>/<chunk key>          (one per chunk, all stages)

The chunk key is the hash chain value of the chunk's last block (protocol/hashing.py),
so it names the chunk's whole prefix, and the chain is seeded with the namespace: keys of
two namespaces never collide. The namespace hash in the key (and in every object header)
makes that explicit and lets an operator wipe one namespace by prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from protocol.ids import ChunkKey
from protocol.namespace import KVNamespace

KEY_PREFIX = "kvserve"


def namespace_hash(namespace: KVNamespace) -> bytes:
    """16 bytes identifying a namespace (xxh3_128 of its canonical string)."""
    return xxhash.xxh3_128_digest(namespace.key().encode())


@dataclass(frozen=True)
class StageSpec:
    """One prefill pipeline stage: its index and layers [layer_start, layer_end)."""

    index: int
    layer_start: int
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def stages_of(layer_split: tuple[int, ...]) -> list[StageSpec]:
    """The stages of a layer split, e.g. (20, 20, 20, 18) -> [0, 20), [20, 40), ..."""
    out, start = [], 0
    for i, n in enumerate(layer_split):
        out.append(StageSpec(i, start, start + n))
        start += n
    return out


class PoolKeys:
    """Key and group-id strings of one namespace."""

    def __init__(self, namespace: KVNamespace) -> None:
        self.namespace_hash = namespace_hash(namespace)
        self.num_stages = len(namespace.layer_split)
        self._prefix = f"{KEY_PREFIX}/{self.namespace_hash.hex()}"

    def object_key(self, chunk_key: ChunkKey, stage: int) -> str:
        return f"{self._prefix}/{bytes(chunk_key).hex()}/s{stage}of{self.num_stages}"

    def group_id(self, chunk_key: ChunkKey) -> str:
        return f"{self._prefix}/{bytes(chunk_key).hex()}"

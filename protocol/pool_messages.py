"""The pool connector's step metadata and worker reports (prefill_worker/pool_*.py).

They ride inside the engine's step messages as the KV connector's opaque bytes
(protocol/rank_messages.py): the scheduler side (stage 0) sends one PoolStepMeta per step
to every stage's worker; each worker answers with a PoolWorkerReport (or b"").

    PoolStepMeta     loads to start, loads to cancel, chunks to save (this step's KV)
    PoolWorkerReport loads finished on this worker's stages (valid tokens), chunks it
                     stored or could not store, and its counters (PoolCounts) for the
                     instance's metrics (only stage 0 exports metrics)
"""

from __future__ import annotations

import msgspec


class PoolLoad(msgspec.Struct, frozen=True, array_like=True):
    """Fill tokens [token_start, token_end) of a request from chunks first_chunk, ... ."""

    request_id: str
    chunk_keys: list[bytes]
    """Keys of chunks first_chunk, first_chunk + 1, ... up to the one holding token_end - 1."""
    first_chunk: int
    block_ids: list[int]
    """The request's whole block table."""
    token_start: int
    token_end: int


class PoolSave(msgspec.Struct, frozen=True, array_like=True):
    """Save whole chunks of a request's prompt that this step completes."""

    request_id: str
    chunk_keys: list[bytes]
    block_ids: list[list[int]]
    """Per chunk, its blocks (blocks_per_chunk each)."""


class PoolStepMeta(msgspec.Struct, frozen=True):
    loads: list[PoolLoad] = []
    cancels: list[str] = []
    """Requests whose loads are no longer wanted (finished meanwhile): stop early."""
    saves: list[PoolSave] = []


def without_saves(meta: PoolStepMeta, request_ids: set[str]) -> PoolStepMeta:
    """`meta` without the saves of `request_ids` (their forward failed: their KV of the
    step is not valid); loads and cancels stay."""
    saves = [s for s in meta.saves if s.request_id not in request_ids]
    return PoolStepMeta(meta.loads, meta.cancels, saves)


class PoolFailure(msgspec.Struct, frozen=True, array_like=True):
    op: str
    reason: str
    count: int


class PoolCounts(msgspec.Struct):
    """What one worker's pool client counted since its last report."""

    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    load_bytes: int = 0
    save_bytes: int = 0
    checksum_failures: int = 0
    load_in_place: int = 0
    """Objects read in place from this process's own segment (kvpool/client.py read)."""
    save_dropped: int = 0
    failures: list[PoolFailure] = []
    restore_seconds: list[tuple[int, float]] = []
    """(stage, seconds) of each restore part this worker ran."""
    saved_objects: list[tuple[int, int]] = []
    """(stage, objects stored) since the last report."""
    loaded_objects: list[tuple[int, int]] = []
    """(stage, objects read, verified and unpacked) since the last report."""
    restore_phases: list[tuple[int, str, float]] = []
    """(stage, phase, seconds) of restore time by phase since the last report
    (kvpool/metrics.py RESTORE_PHASES)."""

    def is_empty(self) -> bool:
        return self == PoolCounts()


class PoolLoadDone(msgspec.Struct, frozen=True, array_like=True):
    """A load finished on every stage of this worker: `num_tokens` valid from its
    token_start (a whole-chunk prefix; 0 when it failed or was cancelled)."""

    request_id: str
    num_tokens: int


class PoolWorkerReport(msgspec.Struct):
    stages: list[int]
    """The pool stages this worker saves and loads (its process's layers)."""
    loads: list[PoolLoadDone] = []
    saved: list[bytes] = []
    """Chunk keys whose objects of every stage of this worker are stored."""
    unsaved: list[bytes] = []
    """Chunk keys planned for saving that this worker did not store (no free slot, a
    failed write)."""
    save_queue_depth: int = 0
    counts: PoolCounts = msgspec.field(default_factory=PoolCounts)

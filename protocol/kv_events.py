"""What workers tell the router about their KV, for KV-aware routing and admission.

    router ── GET /info ───────────────────────────▶ worker   once (and after a restart)
           ◀─ WorkerInfo                                      namespace key, block size, ...
    router ── GET /kv_events/stream?since=N ────────▶ worker   one long-lived stream
           ◀─ KVEventBatch, KVEventBatch, ...                 pushed: events after N,
                                                              load, rates (NDJSON)

Events are the prefix cache's changes (engine/block_pool.py): `stored` / `removed` carry
block hashes of the chain the router computes itself (protocol/hashing.py, seeded with
`namespace_seed(WorkerInfo.namespace_key)`), `cleared` drops everything, `pool_saved`
carries chunk keys the instance wrote to the pool, `pool_removed` chunk keys it removed
from the pool (its retention, kvpool/retention.py, or what is left of a chunk a lookup
found incomplete). Sequence numbers are per worker
process (`epoch`); a consumer that fell behind the worker's ring, or sees a new epoch,
gets `reset` with a `snapshot` of every cached hash and starts over from `next_seq`.
Reading events never touches the pool (Mooncake existence checks take read leases).
"""

from __future__ import annotations

from typing import Literal

import msgspec

KVEventKind = Literal["stored", "removed", "cleared", "pool_saved", "pool_removed"]


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """GET /info: static facts a router needs to price requests on this instance."""

    name: str
    role: str
    """"prefill" or "decode"."""
    namespace_key: str
    """KVNamespace.key(): the router seeds the hash chain with namespace_seed(this)."""
    block_size: int
    chunk_size: int
    kv_bytes_per_token: int
    """KV bytes of one token over all layers (what a pool restore moves per token)."""
    kv_capacity_tokens: int
    """Tokens the paged KV cache holds (num_blocks x block_size)."""


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Load and measured rates, read in the engine thread at the time of the answer."""

    num_running: int
    num_waiting: int
    queued_tokens: int
    """Prompt tokens admitted but not computed yet (waiting plus running prefills)."""
    kv_blocks_total: int
    kv_blocks_free: int
    compute_tokens_per_s: float | None = None
    """Prompt tokens computed per busy second (EWMA); None until measured."""
    restore_bytes_per_s: float | None = None
    """Pool bytes restored per second of load time (EWMA); None until measured."""


class KVEvent(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    kind: KVEventKind
    hashes: list[bytes]
    """Block hashes (stored / removed), chunk keys (pool_saved / pool_removed), empty
    (cleared)."""


class KVEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """GET /kv_events answer: events with seq >= `since`, up to `next_seq` (exclusive)."""

    epoch: str
    """Changes when the worker process restarts: the consumer must start over."""
    next_seq: int
    reset: bool = False
    """The requested `since` is gone (or from another epoch): `snapshot` replaces all
    the consumer knew, then `events` follow."""
    snapshot: list[bytes] = []
    """Every block hash cached now (only with reset)."""
    events: list[KVEvent] = []
    load: WorkerLoad

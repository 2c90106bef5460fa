"""The KV connector contract: how KV enters and leaves an engine outside its forward.

A connector has two sides. The engine never imports an implementation (the pool, the P->D
handoff); a worker hands the engine both sides with `LLMEngine.set_kv_connector`. "Off" is
`NoConnectorScheduler` / `NoConnectorWorker`, which do nothing. `MultiConnector*`
(engine/kv_connector_multi.py) composes several (a prefill saves to the pool and sends
to decode).

    scheduler side (KVConnectorScheduler)          worker side (KVConnectorWorker)
    ONE per instance, in the process owning        ONE per process holding KV: every PP
    the scheduler (prefill PP stage 0, decode      stage, every TP x DCP rank (the driver's
    TP rank 0), engine thread only.                own too). Engine/stage thread for the
    Never blocks on I/O.                           calls below; transfers run on its threads.

The engine step reads schedule -> execute -> update:

    schedule   admission of a waiting request with a GPU prefix of g tokens (whole blocks):
                 n, is_async = get_num_new_matched_tokens(req, g)   tokens [g, g+n)
                 n None: not known yet (a lookup in flight): the request stays waiting,
                 the next waiting one is considered, and it is asked again next step
                 n > 0: blocks for [0, g+n) allocated; update_state_after_alloc(req,
                 block_ids, n); is_async -> the request waits in WAITING_FOR_KV (no budget,
                 counts against max_num_seqs, others run); not is_async -> the tokens count
                 as computed at once (the workers fill them in start_loads, before the forward)
               meta = build_step_meta(StepKV of every scheduled request: the tokens
                 [start, end) this step computes into block_ids)
    execute    meta rides the step to every worker (protocol/rank_messages.py: StageStep,
               RankStep); on each worker, in this order:
                 start_loads(meta)    before the step's forward
                 forward              (this process's layers / heads / token stripe)
                 start_saves(meta)    after it; ordered after the step's KV writes
                 get_finished()       -> report bytes, shipped back with the step's result
               (a step with nothing to compute still carries meta and reports: the engine
               polls the workers while has_pending() is true)
    update     update_from_workers(one report per worker process, stage / rank order)
                 -> ConnectorUpdate: finished_loads (request -> tokens valid from the
                    load's first token; complete only when EVERY worker reported it),
                    released (requests whose kept blocks are now free to reuse)

Block lifetime: the engine is about to free a request's blocks when it finishes, is
aborted, or is preempted (status WAITING); it calls request_finished(req, block_ids)
first. True = a transfer still reads or writes them: the engine keeps the blocks (out of
the request) until the request id appears in `released`. A load's blocks are never
handed to compute before its finished_loads entry; a save must have read the step's
KV before a later step can overwrite it (a save that copies in start_saves, in the
stream order of the forward, needs no hold; one that reads later must hold, or find the
KV again in the prefix cache: bind_block_pool gives the block pool, whose blocks keep a
content until an allocation hands them out; a block that still carries the hash when
build_step_meta runs can be copied in that step's start_saves, and one the step's own
allocations evict (the block pool's eviction listener) in its start_loads, before its
forward).

What may block: nothing on the scheduler side (a lookup that needs the network runs on
the connector's thread: get_num_new_matched_tokens answers None until it is back);
start_loads and start_saves only queue work or copy in stream order (never wait on a
network); wait() is the one call that sleeps (the engine's idle poll).

Ordering: every worker sees the steps in the order they were scheduled (a PP ring and a
TP broadcast keep it), and the reports of a step reach update_from_workers in step order
(with PP, several steps may be in flight: the report of step k arrives after step k+1 was
scheduled). meta b"" means nothing for this step; the worker is called all the same.

Load results: every worker reports each load exactly once, even a failed or cancelled
one. A load writes only the slots of its tokens, and nothing after it reported. Tokens
valid = a prefix of the load the connector can vouch for on every worker (the pool: the
leading run of whole chunks every stage verified; 0 when it failed); the engine runs the
request again from g + valid and recomputes the rest: never partial data.

Worker calls that raise: each process's worker sits behind engine/kv_connector_guard.py,
which reports the failed call with its meta; the scheduler side's workers_failed names
the requests it concerned, before that step's reports are applied.

Metadata and reports are opaque bytes to the engine (each connector encodes its own
msgspec messages; never pickle): they cross process boundaries inside the step messages.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool
from engine.request import Request
from protocol.ids import BlockId, RequestId
from protocol.parallel import DecodeRankShard


@dataclass(frozen=True)
class WorkerPlace:
    """Where a worker side runs: its process's pipeline stage and layers, and its decode
    rank shard (heads, token stripe) when it is a TP x DCP rank."""

    layer_start: int
    layer_end: int
    stage: int = 0
    num_stages: int = 1
    shard: DecodeRankShard | None = None


@dataclass(frozen=True)
class StepKV:
    """KV a step computes for one request: tokens [token_start, token_end) into the
    request's block table `block_ids` (its whole table at this step)."""

    request: Request
    token_start: int
    token_end: int
    block_ids: list[BlockId]


@dataclass
class ConnectorUpdate:
    """What the workers' reports changed, as the engine needs it."""

    finished_loads: dict[RequestId, int] = field(default_factory=dict)
    """Request -> tokens valid from its load's first token (0: the load failed). Only
    loads every worker finished."""
    released: set[RequestId] = field(default_factory=set)
    """Requests whose blocks, kept after request_finished returned True, are free now."""

    def merge(self, other: ConnectorUpdate) -> None:
        self.finished_loads.update(other.finished_loads)
        self.released |= other.released


class KVConnectorScheduler(ABC):
    """The scheduler side: decides what is loaded, saved and sent; aggregates the workers'
    reports. Engine thread of the scheduler's process only; never blocks on I/O."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(n, is_async): the connector can provide tokens [num_computed_tokens,
        num_computed_tokens + n) (num_computed_tokens: the GPU prefix, whole blocks),
        ending before the request's last token (its logits are needed); n = 0: none;
        n = None: not known yet (ask again next step; has_pending() is True meanwhile).
        is_async: the tokens arrive later (finished_loads); else the workers write them
        in start_loads of this very step, before its forward. Never raises, never
        blocks."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        """Blocks for the request's first request.num_computed_tokens (its GPU prefix) +
        num_external_tokens tokens are allocated (`block_ids`: its whole table): plan the
        load of [num_computed_tokens, + num_external_tokens) into them; it goes out in
        this step's build_step_meta. Called for every admission (0: nothing to load)."""

    @abstractmethod
    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        """What every worker does this step: loads to start, saves / sends of the KV
        `computed` writes, cancellations. b"" when nothing."""

    @abstractmethod
    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        """One report per worker process (stage / rank order; b"" = nothing new)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        """The request finished or was aborted (every request, once; `block_ids` may be
        empty), or was preempted (status WAITING): the engine is about to free its blocks.
        True = keep them until `released` names the request."""

    def bind_block_pool(self, pool: BlockPool) -> None:  # noqa: B027 (optional hook)
        """The engine's block pool, handed over once by set_kv_connector (engine thread;
        read only: `lookup` finds the block that holds a content now). A connector that
        saves KV later than the step that computed it finds it there."""

    def saves_on_eviction(self) -> bool:
        """True when it set the block pool's eviction listener: blocks may then be
        allocated only while a step is scheduled (engine/block_pool.py), so the engine
        does not allocate ahead of a step (decode-ahead)."""
        return False

    def has_pending(self) -> bool:
        """Transfers whose reports are still due: the engine keeps polling its workers
        (empty steps) while True, even with no request to run."""
        return False

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """The step's metadata (from build_step_meta) without the saves and sends of
        `request_ids`: their forward failed, so their KV of this step is not valid and
        must not leave the engine (engine/step_isolation.py). Loads were started before
        the forward and stay. A connector whose workers save or send KV overrides it."""
        return meta

    def workers_failed(self, meta: bytes, error: str, process: int) -> set[RequestId]:
        """A worker call over step metadata `meta` (from build_step_meta) raised in
        process `process` (stage / rank; engine/kv_connector_guard.py caught it): there,
        what `meta` asked may be partly done or not at all, and that process skipped the
        step's saves and sends. Stop expecting what will not be reported, and return the
        requests that must fail now (the engine fails them alone with `error`); a
        request that can go on without what failed (an async load that counts as 0
        valid tokens: it recomputes) is not returned, a synchronous load's request (its
        forward of this step used the load) must be. Called before the step's reports are applied. Default: an empty `meta`
        concerned nothing; NotImplementedError otherwise (the engine then fails the step
        as a whole)."""
        if meta:
            raise NotImplementedError(f"{type(self).__name__} cannot isolate a worker failure")
        return set()

    def close(self) -> None:  # noqa: B027 (optional hook: most connectors hold nothing)
        """Release what the scheduler side holds."""


class KVConnectorWorker(ABC):
    """The worker side in one process: owns that process's transfer threads and streams.
    Calls come from the thread that runs the process's forward, in step order."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        """This process's paged KV (one tensor per local layer) and where it sits."""

    @abstractmethod
    def start_loads(self, meta: bytes) -> None:
        """Begin the step's loads (before its forward); never waits on I/O."""

    @abstractmethod
    def start_saves(self, meta: bytes) -> None:
        """Begin the step's saves / sends (after its forward); never waits on I/O."""

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        """Worker side of KVConnectorScheduler.without_requests: the step's metadata
        without the saves and sends of `request_ids`, because THIS process's forward of
        them failed (a pipeline stage finds its culprits itself; the scheduler side
        learns them with the step's result and stops expecting their saves). Loads
        stay. A connector whose workers save or send KV overrides it."""
        return meta

    @abstractmethod
    def get_finished(self) -> bytes:
        """Report of what finished (or failed) since the last call; b"" for nothing."""

    def wait(self, timeout_s: float) -> None:
        """Sleep until a transfer of this worker (or a lookup of its scheduler side in
        this process) may have finished, or timeout_s: the engine's idle poll. A worker
        that cannot be woken keeps this default, a plain sleep."""
        time.sleep(timeout_s)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop the worker's threads and release its buffers."""


class NoConnectorScheduler(KVConnectorScheduler):
    """The "off" connector's scheduler side: nothing external, nothing saved."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        assert num_external_tokens == 0, "the off connector never matches"

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return b""

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        return ConnectorUpdate()

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        return False


class NoConnectorWorker(KVConnectorWorker):
    """The "off" connector's worker side."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        return None

    def start_loads(self, meta: bytes) -> None:
        return None

    def start_saves(self, meta: bytes) -> None:
        return None

    def get_finished(self) -> bytes:
        return b""

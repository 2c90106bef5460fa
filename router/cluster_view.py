"""ClusterView: what the router knows about every instance beyond its health.

    per instance (InstanceState)                      fed by
      info      namespace key, block size, capacity   GET /info (once per worker epoch)
      load      queue, free blocks, measured rates    pushed on GET /kv_events/stream
      prefix    GPU-resident block hashes (prefill)   KV events stored/removed/cleared
      pool_id   which pool it saves to / restores     cluster.yaml (shared: one pool;
                                                      split: one per node; none)
      outstanding_tokens   prompt tokens the router sent and prefill has not answered
      reserved_tokens      decode KV the admission gate handed out
    per pool (PoolIndex)                              pool_saved / pool_removed events,
                                                      or finished prefills of instances
                                                      that do not report saves
                                                      (router/kv_index.py)

`KVWatcher` holds one long-lived push stream per instance on the router's event loop. Everything here is a hint
for policies and the gate: a stale view costs efficiency, never correctness. Mutated only
on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

from protocol.hashing import chunk_keys, namespace_seed
from protocol.ids import BlockHash
from protocol.internal_auth import auth_headers
from protocol.kv_events import KVEventBatch, WorkerInfo, WorkerLoad
from protocol.messages import PromptUsage
from router.instances import Instance, InstanceRegistry
from router.kv_index import PoolIndex, PrefixIndex

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0


@dataclass
class InstanceState:
    """The router's view of one instance (see the module docstring)."""

    pool_id: str | None = None
    info: WorkerInfo | None = None
    root: BlockHash | None = None
    load: WorkerLoad | None = None
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    epoch: str = ""
    next_seq: int = 0
    reports_pool_saves: bool = False
    outstanding: dict[str, int] = field(default_factory=dict)
    """request id -> prompt tokens sent to this prefill instance, until its first token."""
    reserved: dict[str, int] = field(default_factory=dict)
    """request id -> decode KV tokens the admission gate reserved on this instance."""

    @property
    def outstanding_tokens(self) -> int:
        return sum(self.outstanding.values())

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved.values())

    @property
    def num_in_flight(self) -> int:
        return max(len(self.outstanding), len(self.reserved))


class ClusterView:
    """Owns every InstanceState and PoolIndex (see the module docstring)."""

    def __init__(
        self,
        pool_of: dict[str, str | None] | None = None,
        pool_capacity_bytes: dict[str, int] | None = None,
    ) -> None:
        self._pool_of = pool_of or {}
        self._pool_capacity_bytes = pool_capacity_bytes or {}
        self.states: dict[str, InstanceState] = {}
        self.pools: dict[str, PoolIndex] = {
            p: PoolIndex() for p in set(self._pool_of.values()) if p is not None
        }

    def state(self, inst: Instance) -> InstanceState:
        st = self.states.get(inst.name)
        if st is None:
            st = self.states[inst.name] = InstanceState(pool_id=self._pool_of.get(inst.name))
        return st

    def pool(self, pool_id: str | None) -> PoolIndex | None:
        return None if pool_id is None else self.pools.get(pool_id)

    # -- updates from the watcher ---------------------------------------------------------
    def set_info(self, inst: Instance, info: WorkerInfo) -> None:
        st = self.state(inst)
        st.info = info
        st.root = namespace_seed(info.namespace_key)
        pool = self.pool(st.pool_id)
        cap = self._pool_capacity_bytes.get(st.pool_id or "")
        if pool is not None and cap and pool.capacity_chunks is None:
            chunk_bytes = info.kv_bytes_per_token * info.chunk_size
            # Mooncake evicts at its high watermark (90% by default).
            pool.capacity_chunks = max(1, int(cap * 0.9) // max(1, chunk_bytes))

    def apply_batch(self, inst: Instance, batch: KVEventBatch) -> None:
        st = self.state(inst)
        st.load = batch.load
        if batch.reset:
            st.prefix.reset(batch.snapshot)
        pool = self.pool(st.pool_id)
        for ev in batch.events:
            if ev.kind == "pool_saved":
                st.reports_pool_saves = True
                if pool is not None:
                    pool.add(ev.hashes)
            elif ev.kind == "pool_removed":
                if pool is not None:
                    pool.remove(ev.hashes)
            else:
                st.prefix.apply(ev.kind, ev.hashes)
        st.epoch, st.next_seq = batch.epoch, batch.next_seq

    # -- updates from the serving path ------------------------------------------------------
    def on_prefill_sent(self, inst: Instance, request_id: str, num_tokens: int) -> None:
        self.state(inst).outstanding[request_id] = num_tokens

    def on_prefill_done(
        self,
        inst: Instance,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hashes: list[BlockHash] | None,
        usage: PromptUsage | None,
    ) -> None:
        """Prefill answered (first token or failure). With `usage` (success) the prompt's
        full blocks are now cached there, and saved to its pool if it has one."""
        st = self.state(inst)
        st.outstanding.pop(request_id, None)
        if usage is None or hashes is None:
            return
        st.prefix.blocks.update(hashes)
        pool = self.pool(st.pool_id)
        if pool is not None and st.info is not None:
            per_chunk = st.info.chunk_size // st.info.block_size
            keys = chunk_keys(hashes, per_chunk)
            if not st.reports_pool_saves:
                pool.add(keys)
            elif usage.pool_tokens:
                pool.add(keys[: (usage.gpu_tokens + usage.pool_tokens) // st.info.chunk_size])


class KVWatcher:
    """Subscribes to every instance's pushed KV events (GET /kv_events/stream, NDJSON
    KVEventBatch lines) and applies them as they arrive; start() / stop() on the router's
    event loop. A stream that breaks is opened again after a back-off (from where it
    stopped: the worker resumes the sequence, or resets when it restarted)."""

    def __init__(
        self,
        registry: InstanceRegistry,
        view: ClusterView,
        interval_s: float = 0.05,
        cluster_secret: str | None = None,
    ) -> None:
        self._registry = registry
        self._view = view
        self._interval_s = interval_s
        """The longest a worker holds back news on its stream."""
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(5.0, read=None),
            trust_env=False,
            headers=auth_headers(cluster_secret),
        )
        self._batch_decoder = msgspec.json.Decoder(KVEventBatch)
        self._info_decoder = msgspec.json.Decoder(WorkerInfo)
        self._tasks: list[asyncio.Task[None]] = []
        self.received = 0
        """Batches applied (for tests and the status page)."""

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow(i)) for i in self._registry.all()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self._http.aclose()

    async def _follow(self, inst: Instance) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                if await self._subscribe(inst):
                    backoff = BACKOFF_MIN_S
            except (httpx.HTTPError, msgspec.DecodeError) as e:
                log.debug("KV event stream of %s broke: %s", inst.describe(), e)
            except Exception:  # never let one bad stream end watching
                log.exception("KV event stream of %s failed", inst.describe())
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _subscribe(self, inst: Instance) -> bool:
        """Follow one stream until it ends. True if it delivered anything."""
        st = self._view.state(inst)
        if st.info is None and not await self._fetch_info(inst):
            return False  # a worker without /info: the view stays empty, policies cope
        params: dict[str, str | int | float] = {
            "since": st.next_seq,
            "epoch": st.epoch,
            "interval_s": self._interval_s,
        }
        got = False
        async with self._http.stream("GET", inst.url + "/kv_events/stream", params=params) as resp:
            if resp.status_code != 200:
                return False
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                batch = self._batch_decoder.decode(line)
                st = self._view.state(inst)
                if (batch.epoch != st.epoch and st.epoch) or st.info is None:
                    # A restarted worker (its namespace or capacity may have changed), or
                    # a view that was reset.
                    await self._fetch_info(inst)
                self._view.apply_batch(inst, batch)
                self.received += 1
                got = True
        return got

    async def _fetch_info(self, inst: Instance) -> bool:
        resp = await self._http.get(inst.url + "/info")
        if resp.status_code != 200:
            return False
        self._view.set_info(inst, self._info_decoder.decode(resp.content))
        return True

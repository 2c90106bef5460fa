"""ClusterView: what the router knows about every instance beyond its health.

    per instance (InstanceState)                      fed by
      info      namespace key, block size, capacity   GET /info (once per worker epoch)
      load      queue, free blocks, measured rates    GET /kv_events, every poll
      prefix    GPU-resident block hashes (prefill)   KV events stored/removed/cleared
      pool_id   which pool it saves to / restores     cluster.yaml (shared: one pool;
                                                      split: one per node; none)
      outstanding_tokens   prompt tokens the router sent and prefill has not answered
      reserved_tokens      decode KV the admission gate handed out
    per pool (PoolIndex)                              pool_saved events, or finished
                                                      prefills of instances that do not
                                                      report saves (router/kv_index.py)

`KVWatcher` polls every instance on the router's event loop. Everything here is a hint
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
from protocol.kv_events import KVEventBatch, WorkerInfo, WorkerLoad
from protocol.messages import PromptUsage
from router.instances import Instance, InstanceRegistry
from router.kv_index import PoolIndex, PrefixIndex

log = logging.getLogger(__name__)


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
    """Polls GET /info and GET /kv_events of every instance; start() / stop() on the
    router's event loop. One failed poll is logged at debug and retried next period."""

    def __init__(
        self, registry: InstanceRegistry, view: ClusterView, interval_s: float = 0.2
    ) -> None:
        self._registry = registry
        self._view = view
        self._interval_s = interval_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0), trust_env=False)
        self._batch_decoder = msgspec.json.Decoder(KVEventBatch)
        self._info_decoder = msgspec.json.Decoder(WorkerInfo)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._http.aclose()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(i) for i in self._registry.all()))

    async def _poll(self, inst: Instance) -> None:
        st = self._view.state(inst)
        try:
            if st.info is None:
                resp = await self._http.get(inst.url + "/info")
                if resp.status_code != 200:
                    return  # a worker without /info: the view stays empty, policies cope
                self._view.set_info(inst, self._info_decoder.decode(resp.content))
            resp = await self._http.get(
                inst.url + "/kv_events", params={"since": st.next_seq, "epoch": st.epoch}
            )
            if resp.status_code != 200:
                return
            batch = self._batch_decoder.decode(resp.content)
            if batch.epoch != st.epoch and st.epoch:
                # A restarted worker: its namespace or capacity may have changed.
                resp = await self._http.get(inst.url + "/info")
                if resp.status_code == 200:
                    self._view.set_info(inst, self._info_decoder.decode(resp.content))
            self._view.apply_batch(inst, batch)
        except (httpx.HTTPError, msgspec.DecodeError) as e:
            log.debug("KV poll of %s failed: %s", inst.describe(), e)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except Exception:  # never let one bad poll end watching
                log.exception("KV poll failed")
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started)))

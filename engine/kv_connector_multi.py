"""MultiConnector: several KV connectors behind one (a prefill saves to the pool and
sends its KV to decode), both sides.

    meta of a step   = msgpack list[bytes], one entry per part (b"" when all are empty)
    a worker report  = msgpack list[bytes], one entry per part (b"" when all are empty)

Loads: the first part that matches tokens for a request owns its load (the others are
told about the allocation with 0 external tokens). Blocks: kept while ANY part holds
them (request_finished True) and released once every holding part released them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from engine.block_pool import BlockPool
from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorScheduler,
    KVConnectorWorker,
    StepKV,
    WorkerPlace,
)
from engine.request import Request
from protocol.ids import BlockId, RequestId

_parts = msgspec.msgpack.Decoder(list[bytes])


def _pack(parts: list[bytes]) -> bytes:
    return msgspec.msgpack.encode(parts) if any(parts) else b""


def _unpack(payload: bytes, n: int) -> list[bytes]:
    if not payload:
        return [b""] * n
    parts = _parts.decode(payload)
    assert len(parts) == n, f"a multi-connector payload of {len(parts)} parts, {n} expected"
    return parts


class MultiConnectorScheduler(KVConnectorScheduler):
    """Owns its parts' scheduler sides, which part loads each request, and which parts
    still hold each finished request's blocks."""

    def __init__(self, parts: Sequence[KVConnectorScheduler]) -> None:
        assert parts, "a multi-connector needs at least one part"
        self.parts = list(parts)
        self._owner: dict[RequestId, int] = {}
        self._holders: dict[RequestId, set[int]] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        for i, part in enumerate(self.parts):
            n, is_async = part.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None:  # not known yet: the parts after it wait for it
                return None, is_async
            if n > 0:
                self._owner[request.request_id] = i
                return n, is_async
        self._owner.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[BlockId], num_external_tokens: int
    ) -> None:
        owner = self._owner.pop(request.request_id, None) if num_external_tokens else None
        for i, part in enumerate(self.parts):
            part.update_state_after_alloc(
                request, block_ids, num_external_tokens if i == owner else 0
            )

    def bind_block_pool(self, pool: BlockPool) -> None:
        for p in self.parts:
            p.bind_block_pool(pool)

    def saves_on_eviction(self) -> bool:
        return any(p.saves_on_eviction() for p in self.parts)

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return _pack([p.build_step_meta(computed) for p in self.parts])

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        if not meta:
            return meta
        parts = _unpack(meta, len(self.parts))
        return _pack(
            [p.without_requests(m, request_ids) for p, m in zip(self.parts, parts, strict=True)]
        )

    def workers_failed(self, meta: bytes, error: str, process: int) -> set[RequestId]:
        """Every part's share of the failed call's metadata (the call covered them all)."""
        if not meta:
            return set()
        failing: set[RequestId] = set()
        for p, m in zip(self.parts, _unpack(meta, len(self.parts)), strict=True):
            failing |= p.workers_failed(m, error, process)
        return failing

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        per_worker = [_unpack(r, len(self.parts)) for r in reports]
        out = ConnectorUpdate()
        for i, part in enumerate(self.parts):
            got = part.update_from_workers([w[i] for w in per_worker])
            out.finished_loads.update(got.finished_loads)
            for rid in got.released:
                holders = self._holders.get(rid)
                if holders is None:
                    continue
                holders.discard(i)
                if not holders:
                    del self._holders[rid]
                    out.released.add(rid)
        return out

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        holders = {i for i, p in enumerate(self.parts) if p.request_finished(request, block_ids)}
        self._owner.pop(request.request_id, None)
        if not holders:
            return False
        self._holders.setdefault(request.request_id, set()).update(holders)
        return True

    def has_pending(self) -> bool:
        return any(p.has_pending() for p in self.parts)

    def close(self) -> None:
        for p in self.parts:
            p.close()


class MultiConnectorWorker(KVConnectorWorker):
    """Owns its parts' worker sides in one process; splits meta, joins reports."""

    def __init__(self, parts: Sequence[KVConnectorWorker]) -> None:
        assert parts, "a multi-connector needs at least one part"
        self.parts = list(parts)

    def register_kv_caches(self, kv_caches: list[torch.Tensor], place: WorkerPlace) -> None:
        for p in self.parts:
            p.register_kv_caches(kv_caches, place)

    def start_loads(self, meta: bytes) -> None:
        for p, m in zip(self.parts, _unpack(meta, len(self.parts)), strict=True):
            p.start_loads(m)

    def start_saves(self, meta: bytes) -> None:
        for p, m in zip(self.parts, _unpack(meta, len(self.parts)), strict=True):
            p.start_saves(m)

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        if not meta:
            return meta
        parts = _unpack(meta, len(self.parts))
        return _pack(
            [p.without_requests(m, request_ids) for p, m in zip(self.parts, parts, strict=True)]
        )

    def get_finished(self) -> bytes:
        return _pack([p.get_finished() for p in self.parts])

    def wait(self, timeout_s: float) -> None:
        # Threads cannot wait on several events at once: wait on the first part that can
        # be woken (its own wait), or sleep when none can.
        wakeable = [p for p in self.parts if type(p).wait is not KVConnectorWorker.wait]
        if wakeable:
            wakeable[0].wait(timeout_s)
        else:
            super().wait(timeout_s)

    def close(self) -> None:
        for p in self.parts:
            p.close()

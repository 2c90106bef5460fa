"""PoolClient: lookups, stage reads and stage writes of chunk objects, over one backend.

One PoolClient per prefill device: it holds the device's registered SlotBuffer and
writes/reads the objects of the stages that device runs (`local_stages`), while lookups
cover every stage of the namespace (the hit rule). Calls are synchronous and
thread-safe; the prefill worker calls them from its own threads (engine/kv_connector.py).

Hit rule (DESIGN §4): chunk c is a hit only if every stage holds its object, and a prefix
only as far as every chunk before it is a hit:

    stage 0:  c0 c1 c2 c3 .      leading run per stage: 4
    stage 1:  c0 c1 .  c3 c4                            2
    stage 2:  c0 c1 c2 c3 c4                            5   -> hit = min = 2 chunks

Failures never raise out of here: an unreachable pool, a missing key, or an object whose
size, header or checksum differs is a miss, counted in PoolMetrics (op, reason); damaged
objects are removed at once.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence

import torch

from kvpool import faults
from kvpool.backend import GetResult, PoolBackend
from kvpool.breaker import Breaker
from kvpool.buffer import SLOT_ALIGN, SlotBuffer
from kvpool.errors import KeyStatus, PoolConfigError, PoolUnavailableError
from kvpool.keys import PoolKeys, StageSpec, stages_of
from kvpool.metrics import PoolMetrics
from kvpool.object_format import (
    ObjectSpec,
    check_object,
    payload_checksum_t,
    stored_payload_checksum,
    write_header,
)
from kvpool.stats import StageCounters
from protocol.ids import ChunkKey
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace

log = logging.getLogger(__name__)

PROBE_KEY = "kvserve/probe"
CUDA_HOST_REGISTER_PORTABLE = 1
NO_SPACE_RETRY_S = 0.05


def object_spec(keys: PoolKeys, stage: StageSpec, layout: KVLayout, chunk_size: int) -> ObjectSpec:
    return ObjectSpec(
        namespace_hash=keys.namespace_hash,
        stage=stage.index,
        num_stages=keys.num_stages,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        num_tokens=chunk_size,
        dtype=layout.storage_dtype,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.row_width,
        num_parts=layout.num_parts,
    )


def _is_pinned(ptr: int) -> bool:
    """Whether host address `ptr` is page-locked for CUDA (cudaPointerGetAttributes)."""
    return bool(
        torch.frombuffer((ctypes.c_uint8 * 1).from_address(ptr), dtype=torch.uint8).is_pinned()
    )


def _clear_last_cuda_error() -> None:
    """A failed cudaHostRegister stays this thread's last CUDA error, which torch's next
    kernel launch check would raise as its own: clear it through the CUDA runtime this
    process loaded (torch's cudart bindings have no cudaGetLastError)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError as e:
        log.warning("could not clear the CUDA error of the refused registration: %s", e)


def leading_run(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class PoolClient:
    """Owns a backend connection, the registered slot buffer, the keys and object specs
    of one namespace, and the breaker that skips an unreachable pool."""

    def __init__(
        self,
        backend: PoolBackend,
        namespace: KVNamespace,
        layout: KVLayout,
        *,
        buffer_bytes: int | None,
        max_save_chunks: int,
        metrics: PoolMetrics | StageCounters,
        local_stages: Sequence[int] | None = None,
        pin_memory: bool = False,
        in_place: bool = True,
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        self.metrics = metrics
        self.keys = PoolKeys(namespace)
        self.chunk_size = namespace.chunk_size
        self.stages = stages_of(namespace.layer_split)
        if sum(namespace.layer_split) != layout.num_layers:
            raise PoolConfigError(
                f"layer split {namespace.layer_split} does not cover the model's "
                f"{layout.num_layers} layers"
            )
        wanted = list(range(len(self.stages))) if local_stages is None else list(local_stages)
        self.local_stages = [self.stages[i] for i in wanted]
        self.specs = {
            s.index: object_spec(self.keys, s, layout, self.chunk_size) for s in self.stages
        }
        biggest = max(self.specs[s.index].object_bytes for s in self.local_stages)
        slot_bytes = -(-biggest // SLOT_ALIGN) * SLOT_ALIGN
        per_chunk = len(self.local_stages)
        if buffer_bytes is None:  # the least that works: one chunk to save, one to load
            buffer_bytes = 2 * per_chunk * slot_bytes
        num_slots = buffer_bytes // slot_bytes
        if num_slots < 2 * per_chunk:
            raise PoolConfigError(
                f"pool_buffer_memory of {buffer_bytes} bytes holds {num_slots} pool objects of "
                f"{slot_bytes} bytes; at least {2 * per_chunk} are needed (one chunk to save "
                f"and one to load): raise pool_buffer_memory to >= {2 * per_chunk * slot_bytes}"
            )
        num_save = min(max_save_chunks, num_slots // per_chunk // 2) * per_chunk
        self.buffer = SlotBuffer(backend, slot_bytes, num_slots, num_save, pin_memory=pin_memory)
        self.breaker = Breaker(self._probe)
        self._leases: dict[int, float] = {}
        """Load slot read in place -> time.monotonic() its read lease ends."""
        self._sums: dict[int, int] = {}
        """Load slot read in place -> payload checksum of the header read() checked."""
        self._deferred: set[int] = set()
        """Load slots read in place whose payload checksum `confirm` still has to check."""
        self._pinned: list[int] = []
        """Bases of own-segment ranges this client registered with CUDA (unregistered at
        close, before the backend unmounts them)."""
        self.direct = in_place and self._enable_direct(pin_memory)
        """Objects in this process's own mounted segment can be read in place (read)."""

    def _enable_direct(self, pin_memory: bool) -> bool:
        """Whether reads in place can work here: the backend knows this process's own
        segment, and (CUDA, pin_memory) its ranges are page-locked for the device's DMA
        (registered here once, or already by Mooncake: MC_STORE_PIN_MEMORY_MAX_BYTES). A
        refused registration turns them off: every read goes through the load slots."""
        ranges = self.backend.own_segments()
        if not ranges:
            return False
        if not pin_memory:
            return True
        cudart = torch.cuda.cudart()
        for base, nbytes in ranges:
            if _is_pinned(base):
                continue  # Mooncake pinned it; it unpins it when it unmounts
            t = time.perf_counter()
            rc = int(cudart.cudaHostRegister(base, nbytes, CUDA_HOST_REGISTER_PORTABLE))
            if rc != 0:
                _clear_last_cuda_error()
                log.warning(
                    "cudaHostRegister of the pool segment [%#x, +%d) failed (cudaError %d): "
                    "restores copy through the load slots",
                    base,
                    nbytes,
                    rc,
                )
                self._unpin()
                return False
            self._pinned.append(base)
            log.info(
                "pool segment [%#x, +%d) registered with CUDA in %.1f s: restores read it in place",
                base,
                nbytes,
                time.perf_counter() - t,
            )
        return True

    def _unpin(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()
            for base in self._pinned:
                cudart.cudaHostUnregister(base)
            self._pinned = []

    def _probe(self) -> None:
        self.backend.exists([PROBE_KEY])  # raises while the pool is unreachable

    # -- lookups ------------------------------------------------------------------------
    def lookup(self, chunk_keys: Sequence[ChunkKey]) -> int:
        """How many leading chunks of `chunk_keys` every stage holds (0 when the pool
        cannot answer). Grants the found objects a read lease (Mooncake): call it right
        before loading them."""
        if not chunk_keys:
            return 0
        if self.breaker.is_open:
            self.metrics.failure("lookup", "unreachable")
            return 0
        keys = [self.keys.object_key(c, s.index) for s in self.stages for c in chunk_keys]
        try:
            found = self.backend.exists(keys)
        except PoolUnavailableError as e:
            self.metrics.failure("lookup", KeyStatus.UNAVAILABLE.value)
            self.breaker.trip(str(e))
            return 0
        n = len(chunk_keys)
        hit = min(leading_run(found[i * n : (i + 1) * n]) for i in range(len(self.stages)))
        self.metrics.lookup(hit, n - hit)
        return hit

    # -- reads ----------------------------------------------------------------------------
    def read(
        self,
        stage: int,
        chunk_keys: Sequence[ChunkKey],
        slots: Sequence[int],
        verify_payload: bool = True,
        in_place: bool = False,
    ) -> int:
        """Read stage `stage`'s objects of `chunk_keys` into load `slots` and verify them.
        Returns how many leading chunks are valid in their slots; objects that do not
        match are removed and counted. With verify_payload=False only size and header are
        checked here: the caller checks each payload where it copies it (a GPU, after its
        H2D copy) against `stored_checksum(slot)` and reports a mismatch to `discard`.

        in_place=True: an object in this process's own segment (when `direct`) is not
        copied, its slot stands for it (`buffer.in_place(slot)`: `buffer.payload*` are
        views of the segment). Its header is checked here; with verify_payload=True its
        payload checksum is left to `confirm`, which the caller must call once it has
        used the payloads (so the check covers the bytes it used). A caller that copies
        the payloads elsewhere checks `lease_held` once its copies are done."""
        spec = self.specs[stage]
        buf = self.buffer
        keys = [self.keys.object_key(c, stage) for c in chunk_keys]
        buf.unplace(list(slots))
        for slot in slots:
            self._leases.pop(slot, None)
            self._deferred.discard(slot)
        if self.breaker.is_open:
            self.metrics.failure("load", "unreachable")
            return 0
        t0 = time.perf_counter()
        results: list[GetResult | None] = [None] * len(keys)
        try:
            if in_place and self.direct:
                for i, rep in enumerate(self.backend.locate(keys)):
                    if rep is not None:
                        buf.place(slots[i], rep.ptr, rep.size)
                        self._leases[slots[i]] = rep.lease_until
                        results[i] = rep.size
            t_loc = time.perf_counter()
            todo = [i for i, r in enumerate(results) if r is None]
            if todo:
                got = self.backend.get_into(
                    [keys[i] for i in todo],
                    [buf.ptr(slots[i]) for i in todo],
                    [buf.slot_bytes] * len(todo),
                )
                for i, code in zip(todo, got, strict=True):
                    results[i] = code
        except PoolUnavailableError as e:
            self.metrics.failure("load", KeyStatus.UNAVAILABLE.value)
            self.breaker.trip(str(e))
            return 0
        t1 = time.perf_counter()
        if in_place and self.direct:
            self.metrics.restore_phase(stage, "locate", t_loc - t0)
            t0 = t_loc
        self.metrics.restore_phase(stage, "read", t1 - t0)
        if self._leases:
            self.metrics.load_in_place.inc(sum(buf.in_place(s) for s in slots))
        valid: list[bool] = []
        damaged: list[str] = []
        injected = faults.take("load", stage)
        for i, (key, chunk, slot, res) in enumerate(
            zip(keys, chunk_keys, slots, results, strict=True)
        ):
            if injected and i > 0:
                self.metrics.failure("load", "injected")
                valid.append(False)
                continue
            assert res is not None
            if isinstance(res, KeyStatus):
                self.metrics.failure("load", res.value)
                valid.append(False)
                if res is KeyStatus.INVALID:  # an object of another size than ours
                    damaged.append(key)
                continue
            placed = buf.in_place(slot)
            obj = buf.object(slot)
            reason = check_object(obj, res, spec, chunk, verify_payload and not placed)
            if reason is not None:
                self.metrics.failure("load", reason)
                damaged.append(key)
                valid.append(False)
                continue
            if placed:
                # The header as checked now is what the payload must match, whatever
                # happens to the segment's bytes later.
                self._sums[slot] = stored_payload_checksum(obj)
                if verify_payload:
                    self._deferred.add(slot)
            self.metrics.load_bytes.inc(res)
            valid.append(True)
        self.metrics.restore_phase(stage, "check", time.perf_counter() - t1)
        if damaged:
            self.metrics.checksum_failures.inc(len(damaged))
            log.warning("removing %d damaged pool object(s), e.g. %s", len(damaged), damaged[0])
            self._remove(damaged)
        return leading_run(valid)

    def lease_held(self, slot: int) -> bool:
        """False when `slot` stands for an object read in place whose read lease has
        ended: it may have been evicted (and its memory reused) while it was used."""
        until = self._leases.get(slot)
        return until is None or time.monotonic() < until

    def confirm(
        self, stage: int, chunk_keys: Sequence[ChunkKey], slots: Sequence[int], n: int
    ) -> int:
        """After the caller used the first n objects that read(in_place=True) left in
        `slots`: how many leading ones were valid while used. An object read in place
        must still be under its read lease, and its payload (when read() left it to this
        call) must match the checksum in the header read() checked, computed now over
        the bytes the caller used. Objects copied into their slots were checked by read()."""
        t = time.perf_counter()
        spec = self.specs[stage]
        try:
            return self._confirm(stage, spec, chunk_keys, slots, n)
        finally:
            self.metrics.restore_phase(stage, "check", time.perf_counter() - t)

    def _confirm(
        self,
        stage: int,
        spec: ObjectSpec,
        chunk_keys: Sequence[ChunkKey],
        slots: Sequence[int],
        n: int,
    ) -> int:
        for j in range(n):
            slot = slots[j]
            if not self.buffer.in_place(slot):
                continue
            matches = True
            if slot in self._deferred:
                self._deferred.discard(slot)
                got = payload_checksum_t(self.buffer.payload_bytes(slot, spec.payload_bytes))
                matches = got == self._sums[slot]
            if not self.lease_held(slot):  # its bytes may be another object's by now
                self.metrics.failure("load", "lease_expired")
                return j
            if not matches:
                self.discard(stage, [chunk_keys[j]])
                return j
        return n

    def stored_checksum(self, slot: int) -> int:
        """The payload checksum in the header of the object read into `slot` (read in
        place: as the header read() checked said)."""
        if self.buffer.in_place(slot):
            return self._sums[slot]
        return stored_payload_checksum(self.buffer.object(slot))

    def discard(self, stage: int, chunk_keys: Sequence[ChunkKey], reason: str = "checksum") -> None:
        """Count and remove stage `stage`'s objects of `chunk_keys`, found damaged by the
        caller (a payload checksum mismatch after read(verify_payload=False))."""
        if not chunk_keys:
            return
        keys = [self.keys.object_key(c, stage) for c in chunk_keys]
        self.metrics.failure("load", reason, len(keys))
        self.metrics.checksum_failures.inc(len(keys))
        log.warning("removing %d damaged pool object(s), e.g. %s", len(keys), keys[0])
        self._remove(keys)

    def remove_chunks(self, chunk_keys: Sequence[ChunkKey]) -> None:
        """Remove every stage's object of `chunk_keys` (retention: the client frees room
        itself; kvpool/retention.py). Failures are counted, never raised."""
        if chunk_keys and not self.breaker.is_open:
            self._remove(
                [self.keys.object_key(c, s.index) for c in chunk_keys for s in self.stages]
            )

    def _remove(self, keys: list[str]) -> None:
        try:
            for status in self.backend.remove(keys):
                if status not in (KeyStatus.OK, KeyStatus.MISSING):
                    self.metrics.failure("remove", status.value)
        except PoolUnavailableError:
            self.metrics.failure("remove", KeyStatus.UNAVAILABLE.value)

    # -- writes ---------------------------------------------------------------------------
    def write(
        self,
        stage: int,
        chunk_keys: Sequence[ChunkKey],
        slots: Sequence[int],
        checksums: Sequence[int | None] | None = None,
    ) -> list[bool]:
        """Seal the packed payloads in save `slots` (header + checksum: `checksums[i]` when
        the packer computed it where it packed, else on the host) and store them as
        stage `stage`'s objects of `chunk_keys`, each in its chunk's group. Returns which
        were stored (an existing object counts as stored); failures are counted, and
        NO_SPACE is retried once after NO_SPACE_RETRY_S (the master evicts in the
        background when a put finds the pool full)."""
        spec = self.specs[stage]
        buf = self.buffer
        if self.breaker.is_open:
            self.metrics.failure("save", "unreachable", len(slots))
            return [False] * len(slots)
        sums: Sequence[int | None] = [None] * len(slots) if checksums is None else checksums
        for chunk, slot, cks in zip(chunk_keys, slots, sums, strict=True):
            write_header(buf.object(slot), spec, chunk, cks)
        stored = [False] * len(slots)
        todo = list(range(len(slots)))
        for attempt in range(2):
            keys = [self.keys.object_key(chunk_keys[i], stage) for i in todo]
            groups = [self.keys.group_id(chunk_keys[i]) for i in todo]
            ptrs = [buf.ptr(slots[i]) for i in todo]
            try:
                results = self.backend.put_from(keys, ptrs, [spec.object_bytes] * len(keys), groups)
            except PoolUnavailableError as e:
                self.metrics.failure("save", KeyStatus.UNAVAILABLE.value, len(keys))
                self.breaker.trip(str(e))
                break
            retry = []
            for i, res in zip(todo, results, strict=True):
                if res is KeyStatus.OK:
                    stored[i] = True
                elif res is KeyStatus.NO_SPACE and attempt == 0:
                    retry.append(i)
                else:
                    self.metrics.failure("save", res.value)
            if not retry:
                break
            todo = retry
            time.sleep(NO_SPACE_RETRY_S)
        self.metrics.save_bytes.inc(sum(stored) * spec.object_bytes)
        self.metrics.stage_objects("save", stage, sum(stored))
        return stored

    def save_chunks(
        self,
        chunk_keys: Sequence[ChunkKey],
        slots: Sequence[Sequence[int]],
        checksums: Sequence[Sequence[int | None]] | None = None,
    ) -> list[ChunkKey]:
        """Write every local stage's object of each chunk (slots[c][i]: chunk c's packed
        slot for local_stages[i], checksums[c][i] its payload checksum if known); a chunk that some stage failed to store has its other
        stages' objects removed, so this client never leaves a chunk that only some
        stages can load. Returns the chunks stored whole."""
        ok = [
            self.write(
                stage.index,
                chunk_keys,
                [s[i] for s in slots],
                None if checksums is None else [c[i] for c in checksums],
            )
            for i, stage in enumerate(self.local_stages)
        ]
        per_chunk = list(zip(*ok, strict=True))  # per chunk: stored flag of each stage
        partial = [c for c, f in zip(chunk_keys, per_chunk, strict=True) if any(f) and not all(f)]
        if partial:
            self.metrics.failure("save", "partial_chunk_removed", len(partial))
            self._remove(
                [self.keys.object_key(c, s.index) for c in partial for s in self.local_stages]
            )
        stored = [c for c, f in zip(chunk_keys, per_chunk, strict=True) if all(f)]
        self.metrics.save_chunks.inc(len(stored))
        return stored

    def close(self) -> None:
        self.breaker.close()
        self.buffer.close()
        self._unpin()  # before the backend unmounts (frees) the segment
        self.backend.close()

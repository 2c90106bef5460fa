"""SlotBuffer: the one buffer a prefill device registers with the pool, cut into slots.

    | save slots (packed chunks waiting to be written) | load slots (objects being read) |
    ^ base (page aligned)   each slot: slot_bytes = one object rounded up to 4 KiB

Objects move between slots and Store DRAM with zero-copy calls (no staging copy inside
Mooncake); the device packs into save slots and unpacks from load slots. On a GPU host
the buffer is pinned host memory, so the device copies run at the DMA ceiling.

A load slot can instead stand for an object read in place (`place`): one that lives in
this process's own mounted segment. Its bytes are then the segment's (`object`,
`payload`, `payload_bytes` return views of them) and nothing is copied into the slot.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections import deque

import numpy as np
import torch

from kvpool.backend import PoolBackend
from kvpool.object_format import HEADER_BYTES, ObjectSpec

SLOT_ALIGN = 4096


class SlotBuffer:
    """Owns the registered memory, its free save slots and its load slots. Slot ids
    [0, num_save_slots) are save slots, the rest load slots."""

    def __init__(
        self,
        backend: PoolBackend,
        slot_bytes: int,
        num_slots: int,
        num_save_slots: int,
        *,
        pin_memory: bool = False,
    ) -> None:
        assert slot_bytes % SLOT_ALIGN == 0 and 0 < num_save_slots < num_slots
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.nbytes = slot_bytes * num_slots
        self._mmap: mmap.mmap | None = None
        if pin_memory:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self._mmap = mmap.mmap(-1, self.nbytes)  # anonymous, page aligned
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.array: np.ndarray = self.tensor.numpy()
        self.base_ptr = self.tensor.data_ptr()
        self._backend = backend
        backend.register_buffer(self.base_ptr, self.nbytes)
        self._registered = True
        self.save_slot_ids = list(range(num_save_slots))
        self.load_slot_ids = list(range(num_save_slots, num_slots))
        self._free_save: deque[int] = deque(self.save_slot_ids)
        self._lock = threading.Lock()
        self._in_place: dict[int, torch.Tensor] = {}
        """Load slot -> uint8 view of the object it stands for in the own segment."""

    def ptr(self, slot: int) -> int:
        return self.base_ptr + slot * self.slot_bytes

    def place(self, slot: int, ptr: int, nbytes: int) -> None:
        """Let load `slot` stand for the object at [ptr, +nbytes) (in this process's own
        segment, under a read lease) until `unplace`: nothing is copied."""
        self._in_place[slot] = torch.frombuffer(
            (ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8
        )

    def unplace(self, slots: list[int]) -> None:
        """The slots hold their own bytes again (before a read into them)."""
        for slot in slots:
            self._in_place.pop(slot, None)

    def in_place(self, slot: int) -> bool:
        return slot in self._in_place

    def _bytes(self, slot: int) -> torch.Tensor:
        view = self._in_place.get(slot)
        if view is not None:
            return view
        off = slot * self.slot_bytes
        return self.tensor[off : off + self.slot_bytes]

    def object(self, slot: int) -> np.ndarray:
        """The slot's bytes as a flat uint8 array (header + payload; the object's own
        bytes in the segment for a slot read in place)."""
        return self._bytes(slot).numpy()

    def payload_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's first `nbytes` payload bytes, flat uint8 (in place: the segment's)."""
        return self._bytes(slot)[HEADER_BYTES : HEADER_BYTES + nbytes]

    def payload(self, slot: int, spec: ObjectSpec) -> torch.Tensor:
        """The slot's payload as a [L_s, P, n, H, D] tensor of the spec's dtype."""
        dtype = getattr(torch, spec.dtype)
        return self.payload_bytes(slot, spec.payload_bytes).view(dtype).view(spec.shape)

    @property
    def num_free_save_slots(self) -> int:
        return len(self._free_save)

    def acquire_save(self, n: int) -> list[int] | None:
        """`n` save slots at once, or None (nothing taken) when fewer are free."""
        with self._lock:
            if len(self._free_save) < n:
                return None
            return [self._free_save.popleft() for _ in range(n)]

    def release_save(self, slots: list[int]) -> None:
        with self._lock:
            self._free_save.extend(slots)

    def close(self) -> None:
        self._in_place.clear()
        if self._registered:
            self._registered = False
            self._backend.unregister_buffer(self.base_ptr)

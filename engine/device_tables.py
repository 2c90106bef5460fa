"""DeviceBlockTables: every running request's block table kept on the device, updated by
appending, so a step uploads O(batch) numbers instead of O(context) ones.

A request gets a row when it first appears in a step and keeps it while it appears in
every step; its row holds the block ids uploaded so far:

    step n:   row 3 = [17 4 9 . . .]   uploaded 3   (request r, table [17 4 9])
    step n+1:                          table [17 4 9 22]  -> upload (3, 3, 22) only

A request missing from a step (finished, preempted, or left out of a full step) loses its
row; if it comes back, its whole table is uploaded again (O(its blocks), once). A block
table only ever grows while its request runs (KVCacheManager appends; freeing happens on
finish or preemption, after which the request is absent from at least one step), and the
last uploaded id is compared each step as a cheap check of that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.ids import RequestId


@dataclass(slots=True)
class _Row:
    index: int
    uploaded: int
    last: int  # the block id at uploaded - 1 (-1 when none)


class DeviceBlockTables:
    """Owns `table` [rows, width] int32 on the device; engine thread only. Grows (rows
    or width doubled, contents kept) when a step needs more."""

    def __init__(self, device: torch.device, rows: int = 64, width: int = 64) -> None:
        self.device = device
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._rows: dict[RequestId, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))
        self.uploaded_entries = 0
        """Block ids uploaded so far (tests check that steady decode uploads O(batch))."""

    def update(self, tables: Sequence[tuple[RequestId, Sequence[int]]]) -> list[int]:
        """Make the rows of this step's requests equal their tables; returns each one's row
        in order. Rows of requests not in `tables` are released."""
        present = {rid for rid, _ in tables}
        for rid in [r for r in self._rows if r not in present]:
            self._free.append(self._rows.pop(rid).index)
        need_rows = sum(rid not in self._rows for rid, _ in tables) - len(self._free)
        if need_rows > 0:
            self._grow_rows(self.table.shape[0] + need_rows)
        width = max((len(t) for _, t in tables), default=0)
        if width > self.table.shape[1]:
            self._grow_width(width)
        rows: list[int] = []
        writes: list[int] = []  # flat (row * width + col, value) pairs
        stride = self.table.shape[1]
        for rid, table in tables:
            row = self._rows.get(rid)
            if (
                row is None
                or len(table) < row.uploaded
                or (row.uploaded and table[row.uploaded - 1] != row.last)
            ):
                if row is None:
                    row = _Row(self._free.pop(), 0, -1)
                    self._rows[rid] = row
                row.uploaded = 0  # new, or not an extension of what is there: re-upload
            base = row.index * stride
            for col in range(row.uploaded, len(table)):
                writes.append(base + col)
                writes.append(table[col])
            if len(table) > row.uploaded:
                row.uploaded, row.last = len(table), table[-1]
            rows.append(row.index)
        if writes:
            pairs = torch.tensor(writes, dtype=torch.int64).view(-1, 2)
            pairs = pairs.to(self.device, non_blocking=True)
            self.table.view(-1).index_copy_(0, pairs[:, 0], pairs[:, 1].to(torch.int32))
            self.uploaded_entries += pairs.shape[0]
        return rows

    def _grow_rows(self, rows: int) -> None:
        old = self.table.shape[0]
        new = max(rows, 2 * old)
        table = torch.zeros(new, self.table.shape[1], dtype=torch.int32, device=self.device)
        table[:old] = self.table
        self.table = table
        self._free.extend(range(new - 1, old - 1, -1))

    def _grow_width(self, width: int) -> None:
        old = self.table.shape[1]
        new = max(width, 2 * old)
        table = torch.zeros(self.table.shape[0], new, dtype=torch.int32, device=self.device)
        table[:, :old] = self.table
        self.table = table

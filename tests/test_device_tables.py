"""DeviceBlockTables: rows equal the host block tables after every update, and steady
decode uploads only new block ids (O(batch) per step, not O(context))."""

from __future__ import annotations

import random

import torch

from engine.cuda_graphs import bucket_sizes
from engine.device_tables import DeviceBlockTables
from protocol.ids import RequestId


def _check(dt: DeviceBlockTables, tables: dict[RequestId, list[int]]) -> list[int]:
    items = list(tables.items())
    rows = dt.update(items)
    assert len(set(rows)) == len(rows)
    for row, (_, table) in zip(rows, items, strict=True):
        assert dt.table[row, : len(table)].tolist() == table
    return rows


def test_appends_upload_only_new_entries() -> None:
    dt = DeviceBlockTables(torch.device("cpu"), rows=2, width=2)
    tables = {RequestId(f"r{i}"): list(range(10 * i, 10 * i + 5)) for i in range(5)}
    rows = _check(dt, tables)  # grows rows (2 -> 5+) and width (2 -> 5+)
    assert dt.uploaded_entries == 25
    for step in range(20):
        for t in tables.values():
            if step % 4 == 0:
                t.append(1000 + len(t))
        assert _check(dt, tables) == rows  # rows are stable while requests run
    assert dt.uploaded_entries == 25 + 5 * 5


def test_absent_requests_release_rows_and_changed_tables_reupload() -> None:
    rng = random.Random(0)
    dt = DeviceBlockTables(torch.device("cpu"), rows=4, width=4)
    live: dict[RequestId, list[int]] = {}
    preempted: list[RequestId] = []
    for step in range(300):
        for rid in preempted:  # back after one step away, with newly allocated blocks
            live[rid] = [rng.randrange(100) for _ in range(rng.randint(0, 9))]
        preempted = []
        if live and rng.random() < 0.2:  # finish one
            live.pop(rng.choice(list(live)))
        if live and rng.random() < 0.1:  # preempt one: absent from this step
            rid = rng.choice(list(live))
            live.pop(rid)
            preempted.append(rid)
        if rng.random() < 0.3:
            live[RequestId(f"r{step}")] = [rng.randrange(100) for _ in range(rng.randint(0, 9))]
        for t in live.values():
            if rng.random() < 0.3:
                t.append(rng.randrange(100))
        _check(dt, live)


def test_rows_grow_only_for_more_requests_than_rows() -> None:
    """A step of more requests than before reuses the rows it holds: the table tensor is
    reallocated only past `rows` requests (decode graphs read it in place)."""
    dt = DeviceBlockTables(torch.device("cpu"), rows=9, width=4)
    tables = {RequestId(f"r{i}"): [i] for i in range(3)}
    _check(dt, tables)
    table = dt.table
    tables.update({RequestId(f"r{i}"): [i] for i in range(3, 9)})
    _check(dt, tables)
    assert dt.table is table
    tables[RequestId("r9")] = [9]
    _check(dt, tables)
    assert dt.table is not table and dt.table.shape[0] >= 10


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(200)[-3:] == [160, 192, 224]
    assert bucket_sizes(5) == [1, 2, 4, 8]

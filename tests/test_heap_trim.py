"""prefill_worker/heap_trim.py: freed heap memory that glibc keeps goes back to the OS."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from prefill_worker.heap_trim import HeapTrimmer

MIB = 1 << 20


CHILD = r"""
import ctypes, json, threading
import psutil
from prefill_worker.heap_trim import trim_heap

MIB = 1 << 20
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: psutil.Process().memory_info().rss
seen = {}
small = []


def batch():
    # Freeing a large mmapped block raises glibc's mmap threshold to its size: later
    # blocks up to that size come from the thread's arena, as activations do after a
    # prefill's first large batch.
    libc.free(libc.malloc(8 * MIB))
    blocks = []
    for _ in range(400):
        blocks.append(libc.malloc(MIB // 4))
        small.append(libc.malloc(64))  # something small that lives on between them
        ctypes.memset(blocks[-1], 1, MIB // 4)
    seen["peak"] = rss()
    for b in blocks:
        libc.free(b)
    seen["freed"] = rss()


t = threading.Thread(target=batch)
t.start()
t.join()
seen["trimmed"] = trim_heap()
seen["after"] = rss()
print(json.dumps(seen))
"""


def test_a_trim_returns_what_a_large_batch_left_in_the_heap() -> None:
    """The engine thread's arena after a large batch: its blocks freed, its pages kept,
    until a trim (from another thread, as the trimmer runs). In a fresh process: which
    arena a new thread gets depends on the threads before it."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["peak"] - seen["freed"] < 20 * MIB, seen  # glibc kept the pages
    assert seen["trimmed"]
    assert seen["freed"] - seen["after"] > 80 * MIB, seen


def test_the_trimmer_runs_until_stopped() -> None:
    async def run() -> None:
        trimmer = HeapTrimmer(interval_s=0.01)
        trimmer.start()
        await asyncio.sleep(0.1)
        task = trimmer._task
        assert task is not None and not task.done()
        await trimmer.stop()
        assert task.cancelled() or task.done()

    asyncio.run(run())


if __name__ == "__main__":
    pytest.main([__file__])

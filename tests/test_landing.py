"""LandingArena: first-fit with coalescing, back-pressure by waiting, FIFO, abort, errors,
and the region cap that makes long prompts stream instead of being refused."""

from __future__ import annotations

import threading
import time

import pytest

from transfer import LandingArena, LandingError, LocalTransport
from transfer.landing import ALIGN_BYTES, LandingRegion

PAGE = ALIGN_BYTES


def make_arena(total: int, transport: LocalTransport | None = None) -> LandingArena:
    """An arena whose regions may take all of it (the cap is tested on its own)."""
    return LandingArena(total, transport, max_region_bytes=total)


def test_allocate_free_and_accounting() -> None:
    arena = make_arena(8 * PAGE)
    a = arena.allocate("a", 1, timeout_s=0)
    b = arena.allocate("b", PAGE + 1, timeout_s=0)
    assert a is not None and b is not None
    assert (a.offset_bytes, a.nbytes) == (0, PAGE)
    assert (b.offset_bytes, b.nbytes) == (PAGE, 2 * PAGE)
    assert b.addr == arena.base_addr + PAGE and b.buffer.numel() == 2 * PAGE
    assert arena.used_bytes == 3 * PAGE and arena.total_bytes == 8 * PAGE
    assert arena.region("b") == b
    assert arena.free("a") and arena.used_bytes == 2 * PAGE
    assert arena.region("a") is None


def test_free_ranges_coalesce() -> None:
    arena = make_arena(6 * PAGE)
    for name in "abc":
        assert arena.allocate(name, 2 * PAGE, timeout_s=0) is not None
    assert arena.free_ranges() == []
    arena.free("a")
    arena.free("c")
    assert arena.free_ranges() == [(0, 2 * PAGE), (4 * PAGE, 2 * PAGE)]
    assert arena.allocate("big", 4 * PAGE, timeout_s=0) is None  # fragmented
    arena.free("b")
    assert arena.free_ranges() == [(0, 6 * PAGE)]
    assert arena.allocate("big", 6 * PAGE, timeout_s=0) is not None


def test_first_fit_reuses_the_lowest_hole() -> None:
    arena = make_arena(6 * PAGE)
    for name in "abc":
        arena.allocate(name, 2 * PAGE, timeout_s=0)
    arena.free("b")
    arena.free("c")
    region = arena.allocate("d", PAGE, timeout_s=0)
    assert region is not None and region.offset_bytes == 2 * PAGE


def test_regions_are_capped_so_no_prompt_is_refused() -> None:
    capped = LandingArena(16 * PAGE)  # default: a quarter of the arena per region
    assert capped.max_region_bytes == 4 * PAGE
    start = time.monotonic()
    huge = capped.allocate("huge", 1000 * PAGE, timeout_s=30)  # streams through 4 pages
    assert huge is not None and huge.nbytes == 4 * PAGE and time.monotonic() - start < 1
    small = capped.allocate("small", PAGE, timeout_s=0)
    assert small is not None and small.nbytes == PAGE  # a short prompt takes what it needs


def test_waits_when_full_and_proceeds_when_freed() -> None:
    arena = make_arena(4 * PAGE)
    assert arena.allocate("a", 4 * PAGE, timeout_s=0) is not None
    got: list[LandingRegion | None] = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate("b", PAGE, timeout_s=20)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not got  # waiting, not failed
    arena.free("a")
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert got[0] is not None and got[0].offset_bytes == 0


def test_timeout_returns_none() -> None:
    arena = make_arena(PAGE)
    arena.allocate("a", PAGE, timeout_s=0)
    start = time.monotonic()
    assert arena.allocate("b", PAGE, timeout_s=0.2) is None
    assert 0.15 < time.monotonic() - start < 2
    assert arena.used_bytes == PAGE


def test_waiters_are_served_in_order() -> None:
    """A small request that would fit must not overtake a larger one waiting before it."""
    arena = make_arena(4 * PAGE)
    arena.allocate("a", 3 * PAGE, timeout_s=0)
    got: dict[str, LandingRegion | None] = {}
    big = threading.Thread(target=lambda: got.update(big=arena.allocate("big", 2 * PAGE, 20)))
    big.start()
    time.sleep(0.2)
    assert arena.allocate("small", PAGE, timeout_s=0.2) is None
    arena.free("a")
    big.join(timeout=5)
    assert got["big"] is not None
    assert arena.allocate("small", PAGE, timeout_s=0) is not None


def test_free_on_abort_is_idempotent() -> None:
    arena = make_arena(2 * PAGE)
    arena.allocate("r", PAGE, timeout_s=0)
    assert arena.free("r") is True
    assert arena.free("r") is False  # completion racing an abort
    assert arena.free("never-admitted") is False
    assert arena.used_bytes == 0 and arena.free_ranges() == [(0, 2 * PAGE)]


def test_duplicate_request_and_close() -> None:
    transport = LocalTransport()
    arena = make_arena(2 * PAGE, transport)
    assert transport.is_registered(arena.base_addr, 2 * PAGE)
    arena.allocate("r", 2 * PAGE, timeout_s=0)
    with pytest.raises(LandingError, match="already holds"):
        arena.allocate("r", PAGE, timeout_s=0)
    got: list[LandingRegion | None] = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate("w", PAGE, 20)))
    waiter.start()
    time.sleep(0.1)
    arena.close()
    waiter.join(timeout=5)
    assert got == [None]
    assert not transport.is_registered(arena.base_addr, 1)


def test_arena_size_must_be_page_multiple() -> None:
    with pytest.raises(LandingError):
        LandingArena(PAGE + 1)

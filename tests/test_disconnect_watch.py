"""router/client_conn.py's DisconnectWatch: one watcher task per request cancels the
request's own task when the client leaves, and only while it is guarded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.client_conn import DisconnectWatch


class FakeReceive:
    """ASGI receive after the body: blocks until `leave()`, then http.disconnect."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def __call__(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.gone.set()


def test_guarded_task_is_cancelled_and_can_go_on() -> None:
    async def main() -> str:
        receive = FakeReceive()
        watch = DisconnectWatch(receive)
        assert watch.guard()
        asyncio.get_running_loop().call_later(0.05, receive.leave)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert watch.caught()
            assert not watch.caught()  # once per cancellation
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # undone: the task may go on
        await asyncio.sleep(0)  # and await again without being cancelled
        watch.stop()
        return "left"

    assert asyncio.run(asyncio.wait_for(main(), 5)) == "left"


def test_unguarded_departure_is_only_noted() -> None:
    async def main() -> None:
        receive = FakeReceive()
        watch = DisconnectWatch(receive)
        assert watch.guard()
        watch.unguard()
        receive.leave()
        await asyncio.sleep(0.05)  # not cancelled: nothing is guarded
        assert watch.gone and not watch.caught()
        assert not watch.guard()  # the client already left
        watch.stop()

    asyncio.run(asyncio.wait_for(main(), 5))


def test_other_cancellations_are_not_the_watch() -> None:
    async def main() -> None:
        before = asyncio.all_tasks()
        watch = DisconnectWatch(FakeReceive())
        assert watch.guard()
        assert len(asyncio.all_tasks()) == len(before) + 1  # the watcher
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inner
        assert not watch.caught()
        watch.stop()
        await asyncio.sleep(0.01)
        assert asyncio.all_tasks() == before  # the watcher is gone

    asyncio.run(asyncio.wait_for(main(), 5))

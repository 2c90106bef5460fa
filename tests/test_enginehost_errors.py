"""enginehost/: the answers a worker gives when its instance is lost (a rank or stage
died: 503 to its open streams and every later call, /health included) and when a
request id already has an open stream (409, where a second stream used to take the
first one's outputs, leaving the first request without them); and the stall watchdog (an
engine step that does not return: 503s at once instead of waits, until it returns)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest
from fastapi.responses import Response
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine.llm_engine import LLMEngine
from enginehost.app import base_app
from enginehost.host import EngineHost, InstanceLost
from protocol.internal_auth import auth_headers
from protocol.messages import InstanceStatus

SECRET = "s" * 40


class IdleEngine:
    """What the engine loop asks of an engine with nothing to do."""

    def has_unfinished(self) -> bool:
        return False


def test_lost_instance_and_request_id_in_use() -> None:
    host = EngineHost(cast(LLMEngine, IdleEngine()))
    app = base_app(
        host, lambda: InstanceStatus("w", "prefill", True, 0, 0, 1, 1), CollectorRegistry(), SECRET
    )
    app.router.on_startup.append(host.start)

    @app.post("/open/{rid}")
    async def open_stream(rid: str) -> Response:
        host.open_stream(rid)
        return Response(b"{}", media_type="application/json")

    @app.post("/close/{rid}")
    async def close_stream(rid: str) -> Response:
        host.close_stream(rid)
        return Response(b"{}", media_type="application/json")

    @app.post("/call")
    async def call() -> Response:
        await host.call(lambda e: e.has_unfinished())
        return Response(b"{}", media_type="application/json")

    @app.post("/lose")
    async def lose() -> Response:
        queue = host.open_stream("r2")
        # as the driver's watch thread does
        why = "the instance lost a process: decode rank 1 (pid 7) exited with code -9"
        threading.Thread(target=host.instance_lost, args=(why,)).start()
        item: Any = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(item, InstanceLost)
        return Response(f"{item.status} {item}".encode())

    with TestClient(app, headers=auth_headers(SECRET)) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/call").status_code == 200

        assert client.post("/open/r1").status_code == 200
        second = client.post("/open/r1")
        assert second.status_code == 409 and "already in use" in second.text
        client.post("/close/r1")
        assert client.post("/open/r1").status_code == 200  # free again once closed

        lost = client.post("/lose")
        assert lost.text.startswith("503 the instance lost a process: decode rank 1"), lost.text
        health = client.get("/health")
        assert health.status_code == 503 and "decode rank 1" in health.text
        call = client.post("/call")  # at once: the engine may be stuck with the dead process
        assert call.status_code == 503 and "lost a process" in call.json()["message"]
    host.stop()


class StuckEngine:
    """An engine whose step does not return until `release` is set (a kernel that never
    finishes, a collective whose peer is wedged)."""

    def __init__(self) -> None:
        self.work = False
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        return self.work

    def step(self) -> list[Any]:
        self.in_step.set()
        self.release.wait(30)
        self.work = False
        return []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_stalled_engine_loop_is_unhealthy_until_it_progresses() -> None:
    """A step that does not return for the stall timeout: /health 503 naming the stall,
    the open stream and a call queued behind the step fail with a 503 (no wait), later
    calls at once, an abort does not wait; once the step returns, the stalled request is
    aborted in the engine, /health is 200 and calls are served again."""
    import httpx

    from enginehost.host import EngineStalled

    engine = StuckEngine()
    host = EngineHost(cast(LLMEngine, engine), stall_timeout_s=0.4)
    app = base_app(
        host, lambda: InstanceStatus("w", "prefill", True, 0, 0, 1, 1), CollectorRegistry(), SECRET
    )

    async def main() -> None:
        host.start()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://w")
        assert (await http.get("/health")).status_code == 200
        assert await host.call(lambda e: e.has_unfinished()) is False
        stream = host.open_stream("r1")
        engine.work = True
        host.loop.submit(lambda e: None)  # wake the loop
        await asyncio.to_thread(engine.in_step.wait, 5)
        queued = asyncio.ensure_future(host.call(lambda e: "never runs"))
        await asyncio.sleep(0.1)
        assert not queued.done() and host.unhealthy() is None  # slow is not stalled yet
        item: Any = await asyncio.wait_for(stream.get(), 5)
        assert isinstance(item, EngineStalled) and item.status == 503
        assert "engine loop stalled: no progress for" in str(item)
        with pytest.raises(EngineStalled):  # the call queued behind the stuck step
            await asyncio.wait_for(queued, 1)
        health = await http.get("/health")
        assert health.status_code == 503 and "engine loop stalled" in health.text
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineStalled):  # a new call into a stalled engine
            await host.call(lambda e: None)
        assert await host.abort("r2") is False  # queued behind the step, not awaited
        assert asyncio.get_running_loop().time() - t0 < 0.2
        assert engine.aborted == []
        engine.release.set()
        for _ in range(100):
            if host.unhealthy() is None:
                break
            await asyncio.sleep(0.05)
        assert (await http.get("/health")).status_code == 200
        assert await host.call(lambda e: "served") == "served"
        assert sorted(engine.aborted) == ["r1", "r2"]  # the stalled request, then r2
        await http.aclose()
        host.stop()

    asyncio.run(main())

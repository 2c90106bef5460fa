"""enginehost/: the answers a worker gives when its instance is lost (a rank or stage
died: 503 to its open streams and every later call, /health included) and when a
request id already has an open stream (409, where a second stream used to take the
first one's outputs, leaving the first request without them)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

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

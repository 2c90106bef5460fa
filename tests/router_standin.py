"""Stand-in prefill/decode workers for router tests: they speak protocol/messages.py over
HTTP (the router's real client side) and return canned token ids, no model involved.

`StandinWorker` serves every worker endpoint, so one class plays prefill or decode; its
knobs inject delays, ErrorEvents and mid-stream crashes, and it records what it was sent
(requests, aborts with arrival times). `ServerThread` runs an ASGI app under uvicorn on
127.0.0.1 in a background thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
from cluster_harness import free_ports
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from protocol.kv_events import KVEventBatch, WorkerLoad
from protocol.kv_layout import KVLayout
from protocol.messages import (
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    ErrorEvent,
    FirstToken,
    LandingGrant,
    LandingInfo,
    PrefillRequest,
    PromptUsage,
    TokenBatch,
    encode_line,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
NDJSON = "application/x-ndjson"


@dataclass
class StandinWorker:
    """Canned worker. `tokens` is the whole output: tokens[0] comes from prefill as the
    FirstToken, the rest from decode, one TokenBatch per token every `token_delay_s`.
    Token-level stops only (EOS id `eos_id`, max_tokens): stop strings are the router's."""

    tokens: list[int] = field(default_factory=lambda: [100, 101, 102])
    eos_id: int | None = 2
    usage_split: tuple[int, int] = (0, 0)
    """(gpu_tokens, pool_tokens) to report; the rest of the prompt is "computed"."""
    token_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    ready_delay_s: float = 0.0
    """Decode sends DecodeReady only after this long (an engine reserving pages)."""
    prefill_answers_late: bool = False
    """Prefill's HTTP answer itself (its headers) waits prefill_delay_s, as a server that
    answers with the whole body does, not only its FirstToken."""
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)
    """endpoint ("prefill" | "decode") -> (status, message) sent as ErrorEvent (decode:
    the HTTP answer, before DecodeReady)."""
    crash_decode_after: int | None = None
    """Drop the decode connection after this many batches."""
    healthy: bool = True
    health_delay_s: float = 0.0
    """GET /health answers only after this long (past the router's control timeout: a
    process that keeps its port open but never answers)."""
    received: list[tuple[str, Any]] = field(default_factory=list)
    """("prefill" | "decode", request) in arrival order."""
    landings: list[LandingGrant] = field(default_factory=list)
    """POST /landing's grants in arrival order (not in `received`)."""
    arrivals: dict[tuple[str, str], float] = field(default_factory=dict)
    """("prefill" | "decode" | "landing", request id) -> time.monotonic() at arrival."""
    readies: dict[str, float] = field(default_factory=dict)
    """Request id -> time.monotonic() when its DecodeReady went out."""
    aborts: list[tuple[float, AbortRequest]] = field(default_factory=list)
    resets: int = 0
    kv_capacity_tokens: int | None = None
    """Serve GET /info and /kv_events/stream with this KV capacity; None: no such
    endpoints (404)."""
    kv_subscriptions: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/prefill", self._prefill, methods=["POST"]),
                Route("/decode", self._decode, methods=["POST"]),
                Route("/landing", self._landing, methods=["POST"]),
                Route("/abort", self._abort, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/admin/reset_prefix_cache", self._reset, methods=["POST"]),
                Route("/info", self._info, methods=["GET"]),
                Route("/kv_events/stream", self._kv_events, methods=["GET"]),
            ]
        )

    async def _info(self, request: Request) -> Response:
        from protocol.kv_events import WorkerInfo

        if self.kv_capacity_tokens is None:
            return Response(b"", status_code=404)
        info = WorkerInfo(
            name="standin",
            role="decode",
            namespace_key="standin",
            block_size=16,
            chunk_size=256,
            kv_bytes_per_token=LAYOUT.bytes_per_token,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
        return Response(msgspec.json.encode(info), media_type="application/json")

    async def _kv_events(self, request: Request) -> Response:
        if self.kv_capacity_tokens is None:
            return Response(b"", status_code=404)
        load = WorkerLoad(
            num_running=0, num_waiting=0, queued_tokens=0, kv_blocks_total=0, kv_blocks_free=0
        )
        batch = KVEventBatch(epoch="standin", next_seq=0, load=load)
        self.kv_subscriptions += 1

        async def pushed() -> Any:  # one batch, then a heartbeat now and then
            while True:
                yield msgspec.json.encode(batch) + b"\n"
                await asyncio.sleep(1.0)

        return StreamingResponse(pushed(), media_type=NDJSON)

    def aborted_ids(self) -> set[str]:
        return {a.request_id for _, a in self.aborts}

    def _finish(self, token: int, count: int, max_tokens: int, ignore_eos: bool) -> str | None:
        if token == self.eos_id and not ignore_eos:
            return "stop"
        return "length" if count >= max_tokens else None

    async def _prefill(self, request: Request) -> Response:
        req = msgspec.json.decode(await request.body(), type=PrefillRequest)
        self.arrivals["prefill", req.request_id] = time.monotonic()
        self.received.append(("prefill", req))
        if "prefill" in self.fail:
            status, message = self.fail["prefill"]
            event = ErrorEvent(request_id=req.request_id, status=status, message=message)
            return Response(encode_line(event), media_type=NDJSON)
        n = len(req.prompt_token_ids)
        gpu = min(self.usage_split[0], n)
        pool = min(self.usage_split[1], n - gpu)
        usage = PromptUsage(
            prompt_tokens=n, gpu_tokens=gpu, pool_tokens=pool, computed_tokens=n - gpu - pool
        )
        token = self.tokens[0]
        finish = self._finish(token, 1, req.params.max_tokens, req.params.ignore_eos)

        late = self.prefill_answers_late
        if late and self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)

        async def events() -> Any:
            if self.prefill_delay_s and not late:
                await asyncio.sleep(self.prefill_delay_s)
            yield encode_line(
                FirstToken(
                    request_id=req.request_id,
                    token_id=token,
                    logprob=-0.5 if req.params.logprobs else None,
                    usage=usage,
                    finish_reason=finish,
                )
            )

        return StreamingResponse(events(), media_type=NDJSON)

    async def _decode(self, request: Request) -> Response:
        req = msgspec.json.decode(await request.body(), type=DecodeRequest)
        self.arrivals["decode", req.request_id] = time.monotonic()
        self.received.append(("decode", req))
        if "decode" in self.fail:
            return _error(req.request_id, *self.fail["decode"])
        params = req.params
        n = len(req.prompt_token_ids)
        landing = LandingInfo(
            rank=0,
            transport="local",
            peer="127.0.0.1:0",
            buffer_addr=0,
            capacity_bytes=n * LAYOUT.bytes_per_token,
            layout=LAYOUT,
        )
        ready = DecodeReady(req.request_id, [landing], "http://127.0.0.1:0/kv_notify")

        async def events() -> Any:
            if self.ready_delay_s:
                await asyncio.sleep(self.ready_delay_s)
            self.readies[req.request_id] = time.monotonic()
            yield encode_line(ready)
            count = 1
            for i, token in enumerate(self.tokens[1:]):
                if self.crash_decode_after is not None and i >= self.crash_decode_after:
                    raise ConnectionAbortedError("stand-in crash")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if req.request_id in self.aborted_ids():
                    return
                count += 1
                finish = self._finish(token, count, params.max_tokens, params.ignore_eos)
                if i == len(self.tokens) - 2 and finish is None:
                    finish = "length"  # canned output exhausted
                yield encode_line(
                    TokenBatch(
                        request_id=req.request_id,
                        token_ids=[token],
                        logprobs=[-0.25 if params.logprobs else None],
                        finish_reason=finish,
                        num_output_tokens=count,
                    )
                )
                if finish is not None:
                    return

        return StreamingResponse(events(), media_type=NDJSON)

    async def _landing(self, request: Request) -> Response:
        """POST /landing: decode's landing for a request sent with await_landing
        (recorded in `landings`; `fail["landing"]` answers that error)."""
        grant = msgspec.json.decode(await request.body(), type=LandingGrant)
        self.arrivals["landing", grant.request_id] = time.monotonic()
        self.landings.append(grant)
        if "landing" in self.fail:
            return _error(grant.request_id, *self.fail["landing"])
        return Response(b"{}", media_type="application/json")

    async def _abort(self, request: Request) -> Response:
        self.aborts.append(
            (time.monotonic(), msgspec.json.decode(await request.body(), type=AbortRequest))
        )
        return Response(status_code=204)

    async def _health(self, request: Request) -> Response:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return Response(
            b"ok" if self.healthy else b"down", status_code=200 if self.healthy else 503
        )

    async def _reset(self, request: Request) -> Response:
        self.resets += 1
        return Response(b'{"reset": true}', media_type="application/json")


def _error(request_id: str, status: int, message: str) -> Response:
    body = msgspec.json.encode(ErrorEvent(request_id=request_id, status=status, message=message))
    return Response(body, status_code=status, media_type="application/json")


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (port 0: ephemeral) in a daemon thread."""

    def __init__(self, app: Any, port: int = 0, **config: Any) -> None:
        cfg = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@functools.cache
def smollm2_info() -> Any:
    """The real SmolLM2 ModelInfo (tokenizer + chat template), loaded once per process."""
    from modelinfo.info import load_model_info

    return load_model_info("builtin:smollm2-135m-instruct")


class RouterHarness:
    """A real router (uvicorn, uvloop, httptools, TCP_NODELAY) in front of stand-ins."""

    def __init__(
        self, num_prefill: int = 1, num_decode: int = 1, late_prefill: int = 0, **settings: Any
    ) -> None:
        """`late_prefill`: that many more prefill stand-ins (the last ones), on ports
        chosen now but served only from `start_late()`: instances that come up after
        the router."""
        from router.app import create_app
        from router.config import InstanceEndpoint, RouterSettings
        from router.http_limits import guarded_protocol
        from router.server import NoDelayHttpToolsProtocol

        self.prefill = [StandinWorker() for _ in range(num_prefill)]
        self.decode = [StandinWorker() for _ in range(num_decode)]
        self.worker_servers = [ServerThread(w.app()) for w in (*self.prefill, *self.decode)]
        for s in self.worker_servers:
            s.start()
        urls = [s.url for s in self.worker_servers]
        self.late = [StandinWorker() for _ in range(late_prefill)]
        late_ports = free_ports(late_prefill) if late_prefill else []
        self.late_servers = [
            ServerThread(w.app(), port=port) for w, port in zip(self.late, late_ports, strict=True)
        ]
        urls[num_prefill:num_prefill] = [f"http://127.0.0.1:{port}" for port in late_ports]
        self.prefill += self.late
        num_prefill += late_prefill
        self.settings = RouterSettings(
            model="builtin:smollm2-135m-instruct",
            port=0,
            prefill=tuple(
                InstanceEndpoint(name=f"p{i}", url=u) for i, u in enumerate(urls[:num_prefill])
            ),
            decode=tuple(
                InstanceEndpoint(name=f"d{i}", url=u) for i, u in enumerate(urls[num_prefill:])
            ),
            **settings,
        )
        self.info = smollm2_info()
        self.app = create_app(self.settings, self.info)
        http = guarded_protocol(self.settings.http_limits, NoDelayHttpToolsProtocol)
        self.router = ServerThread(self.app, loop="uvloop", http=http)
        self.router.start()
        self.url = self.router.url

    @property
    def served_name(self) -> str:
        return str(self.settings.served_model_name or self.info.served_name)

    def reset(self) -> None:
        """Fresh stand-in state (knobs and records), every instance healthy again."""
        for w in (*self.prefill, *self.decode):
            fresh = StandinWorker()
            for name in fresh.__dataclass_fields__:
                setattr(w, name, getattr(fresh, name))
        for inst in self.app.state.registry.all():
            self.app.state.registry.mark_healthy(inst)

    def set_output(self, tokens: list[int], **knobs: Any) -> None:
        for w in (*self.prefill, *self.decode):
            w.tokens = list(tokens)
            for k, v in knobs.items():
                setattr(w, k, v)

    def openai(self, **kwargs: Any) -> Any:
        import httpx
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=kwargs.pop("api_key", "unused"),
            http_client=httpx.Client(trust_env=False, timeout=30),
            max_retries=0,
            **kwargs,
        )

    def start_late(self) -> None:
        for s in self.late_servers:
            s.start()
        self.worker_servers += self.late_servers

    def close(self) -> None:
        self.router.stop()
        for s in self.worker_servers:
            s.stop()


def _main() -> None:
    """`python tests/router_standin.py PORT NUM_TOKENS TOKEN_DELAY_S`: a stand-in worker
    process (for tests that kill a worker outright)."""
    import sys

    port, num_tokens, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    worker = StandinWorker(tokens=list(range(100, 100 + num_tokens)), token_delay_s=delay)
    uvicorn.run(worker.app(), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    _main()

"""Running the router app under uvicorn: uvloop, httptools, TCP_NODELAY on every client
connection (a streamed chunk must leave at once, not wait for the previous one's ACK),
one write per event-loop turn (router/write_coalescing.py), the HTTP limits of
router/http_limits.py (sizes and timeouts of headers and body), and the generation
routes served by the protocol itself (router/generation_cycle.py)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from prometheus_client import start_http_server

from modelinfo.info import ModelInfo, load_model_info
from router.app import create_app
from router.config import RouterSettings
from router.edge import INTERNAL_HOST, NativeDataPlane
from router.edge_process import EdgeError
from router.generation_cycle import GenerationRoutes
from router.http_limits import GuardedHttpToolsProtocol, HttpLimits, guarded_protocol
from router.write_coalescing import CoalescingTransport

log = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 20_000
"""Net container allocations between young-generation collections (CPython's default:
700). See `tune_gc`."""


def tune_gc() -> None:
    """Collect what startup left, freeze the survivors, and collect the young generation
    less often: the router's requests make no lasting cycles, so nearly all that the
    collector did was scan live objects.

    With CPython's defaults, 64 requests in flight keep ~thousands of containers alive
    (parsed bodies, runs, generators), so the young generation passed its 700 every few
    requests and each collection moved them on; the full collections then walked the
    ~100,000 objects startup leaves (the tokenizer's tables, FastAPI, templates), ~70 ms
    each, every ~1,600 requests. Measured in front of benchmarks/router_standins.py at 64
    connections (CPU time inside the collector, `gc.callbacks`): ~100 µs per request with
    the defaults, ~45 µs with the startup heap frozen, ~3 µs frozen and with this
    threshold. Cyclic garbage still gets collected, after at most this many net
    allocations (a few MB)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


class NoDelayHttpToolsProtocol(GuardedHttpToolsProtocol, GenerationRoutes):
    """uvicorn's httptools protocol with Nagle's algorithm turned off explicitly, the
    writes of one event-loop turn coalesced (router/write_coalescing.py), the HTTP
    limits of router/http_limits.py, and the generation routes served without ASGI
    (router/generation_cycle.py; the limits apply to them as to every request)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._coalescing = CoalescingTransport(transport, asyncio.get_running_loop())
        super().connection_made(self._coalescing)  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        # The response is whole: send it now rather than at the next loop turn, so what
        # the handler does after its last byte (metrics) is not in the client's way.
        self._coalescing.flush()
        super().on_response_complete()


def uvicorn_config(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    limits: HttpLimits | None = None,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=guarded_protocol(limits or HttpLimits(), NoDelayHttpToolsProtocol),
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # nothing reads the client address: no middleware for it
        timeout_keep_alive=30,
        backlog=4096,
    )


def run_router(
    settings: RouterSettings,
    log_level: str = "info",
    on_server: Callable[[uvicorn.Server], None] | None = None,
) -> None:
    """Load the model's tokenizer and template, then serve until interrupted.
    `on_server` is given the uvicorn Server before it runs (its `should_exit` says when
    it was told to stop: router/processes.py reads it)."""
    model = load_model_info(settings.model, served_name=settings.served_model_name)
    # The streamed-detokenization table (modelinfo/token_bytes.py), built now rather than
    # inside the first request.
    _ = model.tokenizer.token_bytes
    app = create_app(settings, model)
    metrics_port = settings.own_metrics_port
    if metrics_port is not None:
        start_http_server(metrics_port, addr=settings.host, registry=app.state.metrics.registry)
    process = ""
    if settings.processes > 1:
        process = f", process {settings.process_index} of {settings.processes}"
    log.info(
        "router serving %s on http://%s:%d (policy %s, %d prefill, %d decode%s)",
        settings.served_model_name or model.served_name,
        settings.host,
        settings.port,
        settings.policy,
        len(settings.prefill),
        len(settings.decode),
        process,
    )
    if settings.data_plane == "native":
        _run_native(app, settings, model, log_level)
        return
    config = uvicorn_config(app, settings.host, settings.port, log_level, settings.http_limits)
    sockets = None
    if settings.processes > 1:  # every process binds the port itself (router/processes.py)
        sockets = [shared_listener(settings.host, settings.port, config.backlog)]
    tune_gc()
    server = uvicorn.Server(config)
    if on_server is not None:
        on_server(server)
    server.run(sockets=sockets)


class NativeServer(uvicorn.Server):
    """uvicorn's Server on the internal listener, with the edge started once it serves
    and stopped before it stops (router/edge.py): the edge's in-flight requests still
    reach the control plane and the internal listener while it drains."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, native: NativeDataPlane) -> None:
        super().__init__(config)
        self._app = app
        self.native = native
        self.failure: EdgeError | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        try:
            await self.native.start(self._app, stopping=lambda: bool(self.should_exit))
        except EdgeError as e:
            self.failure = e
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.native.stop_edge()
        await super().shutdown(sockets)
        await self.native.close()


def _run_native(app: FastAPI, settings: RouterSettings, model: ModelInfo, log_level: str) -> None:
    """Serve on loopback for the edge, which serves settings.host:settings.port."""
    config = uvicorn_config(app, INTERNAL_HOST, 0, log_level, settings.http_limits)
    native = NativeDataPlane(settings, model, config.backlog)
    server = NativeServer(config, app, native)
    log.info(
        "kvserve-edge serves http://%s:%d; this router is its control plane on %s",
        settings.host,
        settings.port,
        native.python_url,
    )
    tune_gc()
    try:
        server.run(sockets=[native.listener])
    finally:
        native.listener.close()
        native.remove_files()
    if server.failure is not None:
        raise server.failure


def shared_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on (host, port) with SO_REUSEPORT: each router process binds
    its own, and the kernel spreads incoming connections over them (by a hash of the
    client's address and port); a connection stays with its process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock

"""The router's FastAPI app: OpenAI routes, admin fan-out, health, metrics, error shapes.

    POST /v1/chat/completions, /v1/completions   generation (router/serving.py)
    GET  /v1/models                               the one served model
    POST /v1/admin/reset_prefix_cache             fan out to every prefill / unified instance
    GET  /health                                  the router is up (+ instance health)
    GET  /metrics                                 Prometheus text

Every error, FastAPI's own included (404 path, 405 method, validation), is answered in
OpenAI's {"error": {...}} shape. /v1 routes need the API key when one is configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from modelinfo.info import ModelInfo
from router.admission import AdmissionGate, AdmissionSettings
from router.cluster_view import ClusterView, KVWatcher
from router.config import RouterSettings
from router.errors import APIError, InvalidRequest, NotFound
from router.fast_path import RouterApp
from router.health import HealthMonitor
from router.instances import Instance, InstanceRegistry
from router.metrics import RouterMetrics
from router.openapi import install_openapi
from router.policies import make_policy
from router.preprocess import Preprocessor
from router.relay import RelayServices
from router.request_body import RawRequest
from router.serving import ServingContext, error_response, serve_generation
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)
RESET_TIMEOUT_S = 30.0


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def create_app(settings: RouterSettings, model: ModelInfo) -> FastAPI:
    """The app for `settings`, serving `model` (loaded once by the caller)."""
    registry = InstanceRegistry(
        [Instance(e.name, "prefill", e.url.rstrip("/")) for e in settings.prefill],
        [Instance(e.name, "decode", e.url.rstrip("/")) for e in settings.decode],
        [Instance(e.name, "unified", e.url.rstrip("/")) for e in settings.unified],
    )
    client = WorkerClient(
        connect_timeout_s=settings.connect_timeout_s,
        health_timeout_s=settings.health_timeout_s,
        cluster_secret=settings.cluster_secret,
    )
    metrics = RouterMetrics(policy=settings.policy)
    metrics.watch_instances(registry)
    served_name = settings.served_model_name or model.served_name
    view = ClusterView(
        pool_of={e.name: e.pool for e in (*settings.prefill, *settings.unified)},
        pool_capacity_bytes=dict(settings.pool_capacity_bytes),
    )
    gate = None
    if settings.admission and not settings.unified:  # a unified instance lands no decode KV
        gate = AdmissionGate(
            view,
            AdmissionSettings(
                wait_timeout_s=settings.admission_wait_timeout_s,
                headroom=settings.process_admission_headroom,
                max_waiting=settings.admission_max_waiting,
                order=settings.admission_order,
                pass_bound_s=settings.admission_pass_bound_s,
            ),
            metrics,
        )
    ctx = ServingContext(
        model=model,
        preprocessor=Preprocessor(
            model,
            served_name,
            settings.max_input_tokens,
            settings.max_output_tokens,
            tool_parser=settings.tool_parser,
        ),
        services=RelayServices(
            registry=registry,
            policy=make_policy(settings.policy, settings.policy_seed, view),
            client=client,
            on_route=metrics.on_route,
            view=view,
            gate=gate,
        ),
        metrics=metrics,
        request_timeout_s=settings.request_timeout_s,
        api_key=settings.api_key,
        session_headers=settings.session_headers,
    )
    health = HealthMonitor(registry, client, settings.health_interval_s)
    watcher = KVWatcher(
        registry, view, settings.kv_poll_interval_s, cluster_secret=settings.cluster_secret
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await health.start()
        watcher.start()
        try:
            yield
        finally:
            await watcher.stop()
            await health.stop()
            await client.aclose()

    app = RouterApp(title="kvserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_openapi(app)
    app.state.serving = ctx
    app.state.registry = registry
    app.state.health = health
    app.state.metrics = metrics
    app.state.view = view

    # POSTs to the generation routes are served by RouterApp before FastAPI's routing;
    # these declarations keep them in /openapi.json (and serve them should a request
    # reach the router another way).
    app.serving = ctx

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_generation(ctx, RawRequest(request.scope, request.receive), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_generation(ctx, RawRequest(request.scope, request.receive), "completion")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ctx.check_auth(request)
        card = {
            "id": served_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvserve",
            "root": model.source.spec,
            "max_model_len": model.max_context_len,
        }
        return _json({"object": "list", "data": [card]})

    @app.post("/v1/admin/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        ctx.check_auth(request)
        prefills = [*registry.instances("prefill"), *registry.instances("unified")]
        results = await asyncio.gather(
            *(client.reset_prefix_cache(i, RESET_TIMEOUT_S) for i in prefills)
        )
        per_instance = {
            inst.name: {"status": status, "body": body}
            for inst, (status, body) in zip(prefills, results, strict=True)
        }
        ok = all(status == 200 for status, _ in results)
        return _json({"success": ok, "instances": per_instance}, 200 if ok else 502)

    @app.get("/health")
    async def health_route() -> Response:
        return _json({"status": "ok", **registry.summary()})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _install_error_handlers(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"invalid value for `{param}`: {first.get('msg', 'invalid request')}"
        return error_response(InvalidRequest(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            error: APIError = NotFound(f"no route {request.method} {request.url.path}")
        else:
            error = APIError(str(exc.detail), status=exc.status_code)
            error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error.headers = dict(exc.headers or {})
        return error_response(error)

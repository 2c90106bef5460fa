"""The two generation routes served straight from ASGI, ahead of FastAPI's routing.

Why: per request, the layers between uvicorn and the handler (Starlette's exception
middleware and routing, FastAPI's exit stack, request/response wrapper, body limit and
telemetry) took ~18% of the router's CPU in benchmarks/router_overhead.py, as much as
relaying the two worker calls. `serve_generation` needs none of them: it answers every
client and worker fault itself in OpenAI's shape and never raises but for cancellation.

Everything else (/v1/models, /health, /metrics, admin, 404 / 405, /openapi.json, which
still lists the generation routes) goes through the FastAPI app as before. Installed
with `app.add_middleware(GenerationRoutes, ctx=...)`: Starlette's outermost error
middleware still wraps it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.serving import ServingContext, serve_generation

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
"""POST path -> serve_generation's endpoint name."""


class GenerationRoutes:
    """ASGI middleware: POST to a generation route is served here, the rest passes on."""

    def __init__(self, app: ASGIApp, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = ROUTES.get(scope["path"])
            if endpoint is not None:
                response = await serve_generation(self.ctx, Request(scope, receive), endpoint)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

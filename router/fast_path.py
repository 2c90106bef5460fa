"""The two generation routes served straight from ASGI, ahead of FastAPI's routing.

Under the router's own server most such requests never reach ASGI: the HTTP protocol
serves an exact-path POST itself (router/generation_cycle.py). What still comes this way
is a generation POST with a query string or escapes, or any request when the app runs
under another server (tests with an ASGI transport).

Why: per request, the layers between uvicorn and the handler (Starlette's error
middleware and routing, FastAPI's telemetry, body limit, exit stack, request/response
wrappers) took ~18% of the router's CPU in benchmarks/router_overhead.py, as much as
relaying the two worker calls. `serve_generation` needs none of them: it answers every
client and worker fault itself in OpenAI's shape and never raises but for cancellation.

`RouterApp` is the FastAPI app with its `__call__` looking at the request first: a POST
to a generation route goes to `serve_generation` with a `RawRequest` (headers and
`receive`, nothing parsed that the route does not read); everything else (/v1/models,
/health, /metrics, admin, 404 / 405, /openapi.json, which still lists the generation
routes) goes through FastAPI as before.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from router.request_body import RawRequest
from router.serving import ServingContext, serve_generation

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
"""POST path -> serve_generation's endpoint name."""


class RouterApp(FastAPI):
    """FastAPI, with POSTs to the generation routes served before its middleware stack.
    `serving` must be set before the first request."""

    serving: ServingContext | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.serving is not None:
            endpoint = ROUTES.get(scope["path"])
            if endpoint is not None:
                response = await serve_generation(
                    self.serving, RawRequest(scope, receive), endpoint
                )
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

"""The router's OpenAPI document with its generation request bodies described.

The generation routes read raw bodies (decoded by msgspec in router/api_types.py, for
speed and exact error messages), so FastAPI cannot see their shape; this fills it in from
the same msgspec structs, so clients and fuzzers (schemathesis, hypothesis-jsonschema)
see what /v1/chat/completions and /v1/completions accept.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router.api_types import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{name}"
BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
"""Route -> the struct its POST body decodes into."""


def request_body_schemas() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(route -> requestBody object, component schemas they reference)."""
    routes = list(BODIES)
    refs, components = msgspec.json.schema_components(
        [BODIES[r] for r in routes], ref_template=_REF
    )
    bodies = {
        route: {"required": True, "content": {"application/json": {"schema": ref}}}
        for route, ref in zip(routes, refs, strict=True)
    }
    return bodies, components


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` describe the generation bodies (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            bodies, components = request_body_schemas()
            for route, body in bodies.items():
                doc["paths"][route]["post"]["requestBody"] = body
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

"""Fuzzing the router's public API: bodies generated from its own OpenAPI document
(hypothesis-jsonschema over the request-body schemas) and mutated into odd ones (wrong
types, random JSON in every field, deep nesting, extreme numbers, huge strings), sent to a
live router in front of stand-in workers. Every answer is below 500 and arrives in time;
afterwards the router still serves exactly. CI sends 500 requests; the slow test 10,000.

Drawing from the schema is slow (~0.1-0.5 s a body), so a module-wide pool of schema
bodies is drawn once and every request picks one and mutates it."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from router_standin import RouterHarness

from router.http_limits import HttpLimits

REQUEST_TIMEOUT_S = 30.0
ROUTES = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def h() -> Iterator[RouterHarness]:
    harness = RouterHarness(
        max_input_tokens=4000,
        request_timeout_s=20,
        http_limits=HttpLimits(max_body_bytes=4 * 1024 * 1024),
    )
    harness.set_output([100, 101, 102, 103])
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def client(h: RouterHarness) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=h.url, trust_env=False, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def body_schemas(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """Route -> a self-contained JSON schema of its body, read from /openapi.json."""
    doc = client.get("/openapi.json").json()
    components = doc["components"]
    out = {}
    for route in ROUTES:
        ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        out[route] = {**ref, "components": components}
    return out


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([5e-324, -5e-324, 1e-46, 1e308, -1e308, 0.0, -0.0, 2**63, -(2**63) - 1]),
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud7ff" * 10, "a" * 200_000, "<|im_start|>", "😀" * 50]),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def _deep(depth: int, leaf: str) -> str:
    return "[" * depth + leaf + "]" * depth


POOL_SIZE = 40
"""Schema bodies drawn per route (the slow test draws more)."""


def schema_pool(schemas: dict[str, dict[str, Any]], size: int) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    """Route -> `size` bodies drawn from its schema (deterministic)."""
    pool: dict[str, list[dict]] = {route: [] for route in schemas}  # type: ignore[type-arg]

    @settings(
        max_examples=size,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(st.tuples(*(from_schema(schemas[route]) for route in ROUTES)))
    def collect(drawn: tuple[dict, ...]) -> None:  # type: ignore[type-arg]
        for route, body in zip(ROUTES, drawn, strict=True):
            pool[route].append(body)

    collect()
    return pool


@st.composite
def bodies(draw: st.DrawFn, pool: dict[str, list[dict]]) -> tuple[str, bytes]:  # type: ignore[type-arg]
    """(route, raw body): a schema-valid body, maybe mutated, or raw odd bytes."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(
        st.sampled_from(["repaired", "repaired", "valid", "mutated", "mutated", "nested", "raw"])
    )
    if kind == "raw":
        raw = draw(
            st.one_of(
                st.binary(max_size=200),
                st.sampled_from(
                    [b"", b"null", b"[]", b"{", b'{"a":1}{', b"\xff\xfe\x00", b"1e999999", b'"x"']
                ),
            )
        )
        return route, raw
    body = dict(draw(st.sampled_from(pool[route])))
    body.setdefault("model", "smollm2-135m-instruct")
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # keep the stand-ins' streams short
    if kind == "repaired":  # past validation, into routing, relay and formatting
        _repair(route, body)
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from([*sorted(body), "n", "stream", "tools", "x_unknown"]))
            body[key] = draw(json_value)
    elif kind == "nested":
        key = draw(st.sampled_from(["messages", "prompt", "stop", "metadata", "tools"]))
        depth = draw(st.sampled_from([50, 999, 1001, 5000, 50_000]))
        text = json.dumps(body)[:-1] + f', "{key}": {_deep(depth, "1")}' + "}"
        if text.startswith("{,"):
            text = "{" + text[2:]
        return route, text.encode()
    return route, json.dumps(body, allow_nan=False).encode()


def _repair(route: str, body: dict[str, Any]) -> None:
    """Make a schema body one the router accepts more often: the served model, a
    non-empty prompt, few choices and tokens, no fields the stand-ins cannot honour."""
    body["model"] = "smollm2-135m-instruct"
    for key in ("tools", "tool_choice", "response_format", "functions", "best_of", "echo"):
        body.pop(key, None)
    if route.endswith("chat/completions"):
        if not body.get("messages"):
            body["messages"] = [{"role": "user", "content": "hi"}]
    elif not body.get("prompt"):
        body["prompt"] = "hi"
    body["n"] = min(max(int(body.get("n") or 1), 1), 3)
    body["max_tokens"] = min(max(int(body.get("max_tokens") or 4), 1), 8)


def _send(client: httpx.Client, route: str, raw: bytes) -> None:
    t0 = time.monotonic()
    with client.stream(
        "POST", route, content=raw, headers={"content-type": "application/json"}
    ) as r:
        for _ in r.iter_raw():
            pass
        status = r.status_code
    assert status < 500, (route, raw[:300], status)
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S


def _still_exact(h: RouterHarness, client: httpx.Client) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": h.served_name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == h.info.tokenizer.decode([100, 101, 102, 103])


def _fuzz(h: RouterHarness, client: httpx.Client, schemas: dict, n: int, size: int) -> None:  # type: ignore[type-arg]
    pool = schema_pool(schemas, size)

    @settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(bodies(pool))
    def run(case: tuple[str, bytes]) -> None:
        _send(client, *case)

    run()
    _still_exact(h, client)
    text = client.get("/metrics").text
    served_5xx = [
        line
        for line in text.splitlines()
        if line.startswith("kvserve_router_requests_total")
        and 'status="5' in line
        and not math.isclose(float(line.rsplit(" ", 1)[1]), 0.0)
    ]
    assert not served_5xx, served_5xx


def test_fuzz_500_requests(
    h: RouterHarness, client: httpx.Client, body_schemas: dict[str, dict[str, Any]]
) -> None:
    _fuzz(h, client, body_schemas, 500, POOL_SIZE)


@pytest.mark.slow
def test_fuzz_10000_requests(
    h: RouterHarness, client: httpx.Client, body_schemas: dict[str, dict[str, Any]]
) -> None:
    _fuzz(h, client, body_schemas, 10_000, 5 * POOL_SIZE)

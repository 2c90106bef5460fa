"""Stand-in workers for benchmarks/router_overhead.py: one process per role (prefill or
decode), answering with canned tokens after the same delays in every protocol, so that
kvserve's router, sglang-router and vllm-router proxy the same work.

Timing (`ttft_s`, 20 ms by default; then the remaining tokens streamed one per write):

kvserve  (protocol/messages.py, NDJSON)
    POST /prefill   FirstToken after ttft_s (sent with await_landing beside /decode)
    POST /decode    DecodeReady at once, then the other tokens as TokenBatches once ttft_s
                    passed (decode waits for prefill's KV; the router calls both at once)
    POST /landing   200 at once (the LandingGrant that forwards DecodeReady)
sglang-router in PD mode (POST /v1/completions to both roles at once, bootstrap_* fields)
    prefill         the first token after ttft_s (JSON, or SSE when asked)
    decode          every token, starting after ttft_s (SSE when asked, else one JSON)
vllm-router in PD mode (POST /v1/completions to prefill with max_tokens 1 and
kv_transfer_params.do_remote_decode; then to decode with prefill's kv_transfer_params)
    prefill         the first token after ttft_s, JSON with kv_transfer_params
    decode          every token at once (prefill's time has already passed)

GET /health, /server_info, /model_info, /metrics and POST /abort answer at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from protocol.kv_layout import KVLayout
from protocol.messages import (
    DecodeReady,
    DecodeRequest,
    FirstToken,
    LandingInfo,
    PrefillRequest,
    PromptUsage,
    TokenBatch,
    encode_line,
)

_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
SERVED = "smollm2-135m-instruct"

Send = Callable[[dict[str, Any]], Awaitable[None]]


def _start(ctype: bytes, length: int | None = None) -> dict[str, Any]:
    headers = [(b"content-type", ctype)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": 200, "headers": headers}


async def _whole(send: Send, body: bytes, ctype: bytes = b"application/json") -> None:
    await send(_start(ctype, len(body)))
    await send({"type": "http.response.body", "body": body})


async def _streamed(send: Send, parts: list[bytes], ctype: bytes, delay_s: float) -> None:
    """The first part at once, the others after `delay_s`, one write each."""
    await send(_start(ctype))
    for i, part in enumerate(parts):
        if i == 1 and delay_s:
            await asyncio.sleep(delay_s)
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _completion(text: str, n_tokens: int, n_prompt: int, finish: str | None) -> dict[str, Any]:
    return {
        "id": "cmpl-standin",
        "object": "text_completion",
        "created": 0,
        "model": SERVED,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_tokens,
            "total_tokens": n_prompt + n_tokens,
        },
    }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def worker_app(role: str, tokens: list[int], pieces: list[str], ttft_s: float) -> Any:
    """Raw ASGI app of one stand-in worker (`role`: prefill or decode)."""
    landing = LandingInfo(0, "local", "127.0.0.1:0", 0, 1 << 20, _LAYOUT)
    n_out = len(tokens)

    async def kvserve_prefill(body: bytes, send: Send) -> None:
        req = msgspec.json.decode(body, type=PrefillRequest)
        n = len(req.prompt_token_ids)
        finish = "length" if req.params.max_tokens == 1 else None
        await asyncio.sleep(ttft_s)
        usage = PromptUsage(n, 0, 0, n)
        await _whole(send, encode_line(FirstToken(req.request_id, tokens[0], None, usage, finish)))

    async def kvserve_decode(body: bytes, send: Send) -> None:
        req = msgspec.json.decode(body, type=DecodeRequest)
        limit = min(n_out, req.params.max_tokens)
        parts = [encode_line(DecodeReady(req.request_id, [landing], "http://127.0.0.1:0/n"))]
        for i in range(1, limit):
            finish = "length" if i == limit - 1 else None
            parts.append(
                encode_line(TokenBatch(req.request_id, [tokens[i]], [None], finish, i + 1))
            )
        await _streamed(send, parts, b"application/x-ndjson", ttft_s)

    async def openai(body: bytes, send: Send) -> None:
        req = json.loads(body)
        n_prompt = len(req.get("prompt") or "")
        remote = req.get("kv_transfer_params") or {}
        limit = min(n_out, int(req.get("max_tokens") or n_out))
        if role == "prefill" or remote.get("do_remote_decode"):
            await asyncio.sleep(ttft_s)
            out = _completion(pieces[0], 1, n_prompt, "length")
            out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": "standin"}
            if req.get("stream"):
                await _whole(send, _sse(out) + b"data: [DONE]\n\n", b"text/event-stream")
            else:
                await _whole(send, json.dumps(out).encode())
            return
        delay = 0.0 if remote else ttft_s  # vllm: prefill's time already passed
        if not req.get("stream"):
            await asyncio.sleep(delay)
            text = "".join(pieces[:limit])
            await _whole(send, json.dumps(_completion(text, limit, n_prompt, "length")).encode())
            return
        parts = [b": open\n\n"]
        for i in range(limit):
            chunk = _completion(pieces[i], 0, 0, "length" if i == limit - 1 else None)
            chunk.pop("usage")
            parts.append(_sse(chunk))
        parts.append(b"data: [DONE]\n\n")
        await _streamed(send, parts, b"text/event-stream", delay)

    routes = {"/prefill": kvserve_prefill, "/decode": kvserve_decode, "/v1/completions": openai}

    async def app(scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        handler = routes.get(scope["path"])
        if handler is not None and scope["method"] == "POST":
            await handler(body, send)
        elif scope["path"] == "/v1/models":
            await _whole(send, json.dumps({"object": "list", "data": [{"id": SERVED}]}).encode())
        elif scope["path"] == "/metrics":
            await _whole(send, b"", b"text/plain")
        else:  # /health, /abort, /server_info, /model_info
            await _whole(send, b"{}")

    return app


def serve(role: str, port: int, tokens: list[int], pieces: list[str], ttft_s: float) -> None:
    import uvicorn
    import uvloop

    config = uvicorn.Config(
        worker_app(role, tokens, pieces, ttft_s),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )
    uvloop.run(uvicorn.Server(config).serve())

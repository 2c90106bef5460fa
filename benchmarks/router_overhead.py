"""Router overhead: the same request served through the router vs. straight to the workers.

A pair of instant stand-in workers (raw ASGI, canned answers, one process) speaks
protocol/messages.py. Two paths are timed in the same run, with the same client (the
router's own keep-alive HTTP/1.1 pool, router/http1.py: httpx would be the bottleneck):

  direct   the client itself opens decode's stream (DecodeReady, then tokens: the
           stand-in answers at once) and prefill's (2 HTTP calls)
  router   the client sends one OpenAI /v1/completions; the router validates, tokenizes,
           routes, makes the same 2 calls, detokenizes and answers in OpenAI's shape

so router minus direct is what the router adds. Latency: sequential requests, p50/p99.
Throughput: `--concurrency` clients for `--seconds`. Correctness first: the router's
text must equal the canned tokens' text before anything is timed.

    python -m benchmarks.router_overhead [--requests 500] [--seconds 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from protocol.kv_layout import KVLayout
from protocol.messages import (
    PROTOCOL_VERSION,
    DecodeReady,
    DecodeRequest,
    FirstToken,
    LandingInfo,
    PrefillRequest,
    PromptUsage,
    TokenBatch,
    encode_line,
)
from protocol.sampling import SamplingParams
from router.http1 import Http1Pool

MODEL = "builtin:smollm2-135m-instruct"
PROMPT = "Write one short sentence about caching."
OUTPUT_TEXT = " Caching keeps recent work close so the next request is fast."
NUM_OUTPUT_TOKENS = 12
_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")


# -- the instant stand-in worker (its own process) ----------------------------------------


def worker_app(tokens: list[int]) -> Callable[..., Awaitable[None]]:
    """Raw ASGI app answering every worker endpoint at once with canned tokens."""
    landing = LandingInfo(0, "local", "127.0.0.1:0", 0, 1 << 20, _LAYOUT)
    n_out = len(tokens)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path == "/prefill":
            req = msgspec.json.decode(body, type=PrefillRequest)
            n = len(req.prompt_token_ids)
            usage = PromptUsage(n, 0, 0, n)
            finish = "length" if req.params.max_tokens == 1 else None
            out = encode_line(FirstToken(req.request_id, tokens[0], None, usage, finish))
        elif path == "/decode":
            req_d = msgspec.json.decode(body, type=DecodeRequest)
            limit = min(n_out, req_d.params.max_tokens)
            ready = DecodeReady(req_d.request_id, [landing], "http://127.0.0.1:0/kv_notify")
            out = encode_line(ready) + b"".join(
                encode_line(
                    TokenBatch(
                        req_d.request_id,
                        [tokens[i]],
                        [None],
                        "length" if i == limit - 1 else None,
                        i + 1,
                    )
                )
                for i in range(1, limit)
            )
        else:  # /abort, /health
            out = b"ok"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})

    return app


def serve_workers(prefill_port: int, decode_port: int, tokens: list[int]) -> None:
    import uvicorn

    async def main() -> None:
        app = worker_app(tokens)
        servers = [
            uvicorn.Server(
                uvicorn.Config(
                    app,
                    host="127.0.0.1",
                    port=p,
                    loop="uvloop",
                    http="httptools",
                    log_level="warning",
                    access_log=False,
                )
            )
            for p in (prefill_port, decode_port)
        ]
        await asyncio.gather(*(s.serve() for s in servers))

    import uvloop

    uvloop.run(main())


def serve_router(port: int, prefill_url: str, decode_url: str) -> None:
    from router.config import InstanceEndpoint, RouterSettings
    from router.server import run_router

    settings = RouterSettings(
        model=MODEL,
        port=port,
        prefill=(InstanceEndpoint(name="p0", url=prefill_url),),
        decode=(InstanceEndpoint(name="d0", url=decode_url),),
    )
    run_router(settings, log_level="warning")


# -- the client ----------------------------------------------------------------------------


class Paths:
    """The two ways of serving one request, with one shared HTTP client."""

    def __init__(
        self, client: Http1Pool, router: str, prefill: str, decode: str, prompt_ids: list[int]
    ) -> None:
        self.client, self.router, self.prefill, self.decode = client, router, prefill, decode
        self.prompt_ids = prompt_ids
        self.params = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, temperature=0.0)
        self.count = 0

    async def _post(self, url: str, body: bytes) -> bytes:
        resp = await self.client.post(url, body)
        try:
            data = await resp.read()
        finally:
            resp.close()
        assert resp.status == 200, (resp.status, data)
        return data

    async def via_router(self) -> str:
        body = msgspec.json.encode(
            {
                "model": "smollm2-135m-instruct",
                "prompt": PROMPT,
                "max_tokens": NUM_OUTPUT_TOKENS,
                "temperature": 0,
            }
        )
        answer = msgspec.json.decode(await self._post(self.router + "/v1/completions", body))
        return str(answer["choices"][0]["text"])

    async def direct(self) -> list[int]:
        self.count += 1
        rid = f"bench-{self.count}"
        enc = msgspec.json.encode
        decode = DecodeRequest(PROTOCOL_VERSION, rid, self.prompt_ids, self.params)
        d_lines = (await self._post(self.decode + "/decode", enc(decode))).splitlines()
        ready = msgspec.json.decode(d_lines[0], type=DecodeReady)
        prefill = PrefillRequest(
            PROTOCOL_VERSION, rid, self.prompt_ids, self.params, ready.landing, ready.notify_url
        )
        lines = (await self._post(self.prefill + "/prefill", enc(prefill))).splitlines()
        first = msgspec.json.decode(lines[0], type=FirstToken)
        batches = [msgspec.json.decode(line, type=TokenBatch) for line in d_lines[1:]]
        return [first.token_id] + [t for b in batches for t in b.token_ids]


async def _latency(fn: Callable[[], Awaitable[object]], n: int) -> dict[str, float]:
    for _ in range(min(50, n)):  # warm-up: connections, caches
        await fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return {
        "p50_ms": 1e3 * samples[len(samples) // 2],
        "p99_ms": 1e3 * samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "mean_ms": 1e3 * sum(samples) / len(samples),
    }


async def _throughput(
    fn: Callable[[], Awaitable[object]], concurrency: int, seconds: float
) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await fn()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from modelinfo.info import load_model_info

    tokenizer = load_model_info(MODEL).tokenizer
    tokens = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:NUM_OUTPUT_TOKENS]
    expected = tokenizer.decode(tokens)
    prefill_port, decode_port, router_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    me = [sys.executable, "-m", "benchmarks.router_overhead"]
    procs = [
        subprocess.Popen(
            [*me, "--serve-workers", str(prefill_port), str(decode_port), json.dumps(tokens)],
            env=env,
        ),
        subprocess.Popen(
            [
                *me,
                "--serve-router",
                str(router_port),
                f"http://127.0.0.1:{prefill_port}",
                f"http://127.0.0.1:{decode_port}",
            ],
            env=env,
        ),
    ]
    try:
        _wait_up(f"http://127.0.0.1:{prefill_port}", procs[0])
        _wait_up(f"http://127.0.0.1:{router_port}", procs[1])
        client = Http1Pool(connect_timeout_s=5.0)
        try:
            paths = Paths(
                client,
                f"http://127.0.0.1:{router_port}",
                f"http://127.0.0.1:{prefill_port}",
                f"http://127.0.0.1:{decode_port}",
                tokenizer.encode(PROMPT),
            )
            text = await paths.via_router()  # correctness before speed
            assert text == expected, (text, expected)
            assert await paths.direct() == tokens
            result: dict[str, Any] = {"output_tokens": len(tokens)}
            for name, fn in (("direct", paths.direct), ("router", paths.via_router)):
                result[name] = await _latency(fn, args.requests)
                result[name]["max_req_per_s"] = await _throughput(
                    fn, args.concurrency, args.seconds
                )
            result["router_overhead_p50_ms"] = (
                result["router"]["p50_ms"] - result["direct"]["p50_ms"]
            )
            return result
        finally:
            client.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-workers":
        serve_workers(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-router":
        serve_router(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=500, help="sequential requests per path")
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput phase per path")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(run(args))
    result["machine"] = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Closed-loop replay of an agent trace against any OpenAI-compatible server.

Every thread of every session is one loop: send its next request once the previous one
finished and its recorded wait (x time_scale) passed; a subagent thread starts when the
parent's request it was spawned after has finished; a request with `join` also waits
for those threads to end. Prompts go to POST /v1/completions as token-id lists, so equal
hash ids become equal token blocks and the server sees the trace's real shared prefixes
(`block_token_ids`: hash id -> deterministic token ids). Outputs use `ignore_eos` and the
recorded length, streamed with usage so TTFT and inter-chunk gaps are measured.

The session id goes in the `x-session-id` header (what session-affinity routing reads).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.agentic.trace import Trace, TraceRequest, TraceThread

TOKEN_LO = 1000
"""Token ids start here: clear of the special tokens at the bottom of most vocabularies."""


@dataclass
class ReplayOptions:
    url: str
    model: str | None = None
    """Model name sent; None: the first of GET /v1/models."""
    time_scale: float = 1.0
    duration_s: float | None = None
    """Stop sending new requests after this long (in-flight ones finish)."""
    vocab_size: int = 32_000
    request_timeout_s: float = 600.0
    start_spread_s: float = 1.0
    """Sessions start at uniform offsets in [0, start_spread_s) (seeded)."""
    seed: int = 0
    api_key: str | None = None
    max_concurrency: int | None = None
    """At most this many requests in flight (None: every thread's loop sends freely). 1
    replays the trace sequentially: each request is sent after the previous one ended, so
    a server whose caches hold the whole trace must reuse exactly the trace's ceiling."""


@dataclass
class RequestResult:
    """One replayed request as the client saw it."""

    session: str
    thread: str
    index: int
    sent_at_s: float
    """Since the replay started."""
    input_length: int
    output_length: int
    hash_ids: list[int] = field(repr=False)
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list, repr=False)
    prompt_tokens: int = 0
    gpu_tokens: int = 0
    pool_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    ended_at_s: float | None = None
    """Since the replay started: when the answer ended (in error or not)."""


class TokenBlocks:
    """Hash id -> its block's token ids, deterministic across runs and processes."""

    def __init__(self, block_tokens: int, vocab_size: int) -> None:
        self.block_tokens = block_tokens
        self.hi = vocab_size
        self._cache: dict[int, list[int]] = {}

    def ids(self, hash_id: int) -> list[int]:
        got = self._cache.get(hash_id)
        if got is None:
            rng = np.random.default_rng(hash_id)
            got = rng.integers(TOKEN_LO, self.hi, self.block_tokens).tolist()
            self._cache[hash_id] = got
        return got

    def prompt(self, req: TraceRequest) -> list[int]:
        out: list[int] = []
        for h in req.hash_ids:
            out.extend(self.ids(h))
        return out[: req.input_length]


class Replayer:
    """Owns one replay: the HTTP client, the per-thread loops and their results."""

    def __init__(self, trace: Trace, opts: ReplayOptions) -> None:
        self.trace = trace
        self.opts = opts
        self.blocks = TokenBlocks(trace.block_tokens, opts.vocab_size)
        self.results: list[RequestResult] = []
        self._done: dict[tuple[str, int], asyncio.Event] = {}
        self._thread_done: dict[str, asyncio.Event] = {}
        self._t0 = 0.0
        self.started_monotonic = 0.0
        """time.monotonic() when the replay started: the origin of every sent_at_s."""
        self._stop_at = float("inf")
        self.model = opts.model or ""
        self._slots = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None

    async def run(self) -> list[RequestResult]:
        headers = {"authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        async with httpx.AsyncClient(
            base_url=self.opts.url.rstrip("/"),
            timeout=httpx.Timeout(self.opts.request_timeout_s, connect=10.0),
            limits=limits,
            headers=headers,
            trust_env=False,
        ) as client:
            if not self.model:
                r = await client.get("/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            for t in self.trace.threads:
                self._thread_done[t.key] = asyncio.Event()
                for i in range(len(t.requests)):
                    self._done[(t.key, i)] = asyncio.Event()
            rng = random.Random(self.opts.seed)
            offsets = {s: rng.uniform(0, self.opts.start_spread_s) for s in self.trace.sessions}
            self._t0 = self.started_monotonic = time.monotonic()
            if self.opts.duration_s is not None:
                self._stop_at = self._t0 + self.opts.duration_s
            await asyncio.gather(
                *(self._thread(client, t, offsets[t.session]) for t in self.trace.threads)
            )
        self.results.sort(key=lambda r: r.sent_at_s)
        return self.results

    async def _thread(self, client: httpx.AsyncClient, t: TraceThread, offset: float) -> None:
        try:
            if t.parent is None:
                await asyncio.sleep(offset)
            else:
                await self._done[(f"{t.session}/{t.parent}", t.spawn_after or 0)].wait()
            for i, req in enumerate(t.requests):
                for j in req.join:
                    ev = self._thread_done.get(f"{t.session}/{j}")
                    if ev is not None:
                        await ev.wait()
                await asyncio.sleep(req.wait_s * self.opts.time_scale)
                if time.monotonic() >= self._stop_at:
                    return
                if self._slots is None:
                    self.results.append(await self._send(client, t, i, req))
                else:
                    async with self._slots:
                        self.results.append(await self._send(client, t, i, req))
                self._done[(t.key, i)].set()
        finally:  # nobody may wait forever on a thread that stopped early
            for i in range(len(t.requests)):
                self._done[(t.key, i)].set()
            self._thread_done[t.key].set()

    async def _send(
        self, client: httpx.AsyncClient, t: TraceThread, index: int, req: TraceRequest
    ) -> RequestResult:
        sent = time.monotonic()
        res = RequestResult(
            t.session,
            t.thread,
            index,
            sent - self._t0,
            req.input_length,
            req.output_length,
            req.hash_ids,
        )
        body = {
            "model": self.model,
            "prompt": self.blocks.prompt(req),
            "max_tokens": req.output_length,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            await self._exchange(client, t, body, sent, res)
        finally:
            res.ended_at_s = time.monotonic() - self._t0
        return res

    async def _exchange(
        self,
        client: httpx.AsyncClient,
        t: TraceThread,
        body: dict,  # type: ignore[type-arg]
        sent: float,
        res: RequestResult,
    ) -> None:
        last = None
        try:
            async with client.stream(
                "POST", "/v1/completions", json=body, headers={"x-session-id": t.session}
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")[:300]
                    res.error = f"HTTP {resp.status_code}: {text}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"].get("message"))
                        return
                    now = time.monotonic()
                    if chunk.get("choices"):
                        if res.ttft_s is None:
                            res.ttft_s = now - sent
                        elif last is not None:
                            res.chunk_gaps_s.append(now - last)
                        last = now
                    usage = chunk.get("usage")
                    if usage:
                        _take_usage(res, usage)
            res.e2e_s = time.monotonic() - sent
            if res.prompt_tokens == 0:
                res.error = "the stream ended without usage"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"


def _take_usage(res: RequestResult, usage: dict) -> None:  # type: ignore[type-arg]
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    res.gpu_tokens = int(details.get("gpu_tokens", cached) or 0)
    res.pool_tokens = int(details.get("pool_tokens") or 0)
    res.computed_tokens = int(
        details.get("computed_tokens", res.prompt_tokens - res.gpu_tokens - res.pool_tokens)
    )

"""The decode instance's HTTP service.

    POST /admit   AdmitRequest  -> AdmitResponse  (a landing region, one LandingInfo per
                  rank; waits while full)
    POST /decode  DecodeRequest -> NDJSON TokenBatch stream
                  checks every flow (prefill stage x rank) landed in full, then every
                  rank scatters its landing -> pages (engine.admit_prefilled), region
                  freed, then one TokenBatch per step (coalesced when the reader lags)

A landing region lives from /admit until its KV is scattered, an abort, or the landing
TTL (a router that died between /admit and /decode must not leak it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from decode_worker.metrics import DecodeMetrics
from decode_worker.ranks import RankLandings
from engine.llm_engine import LLMEngine, RequestOutput
from enginehost.app import base_app, error_response, json_response, read_message
from enginehost.host import EngineHost
from enginehost.kv_events import KVReporter
from protocol.errors import InvalidRequestError, PromptTooLongError
from protocol.ids import BlockId
from protocol.messages import (
    AdmitRequest,
    AdmitResponse,
    DecodeRequest,
    ErrorEvent,
    InstanceStatus,
    TokenBatch,
    encode_line,
)
from transfer import LandingArena, LandingTooLargeError, check_flows
from transfer.errors import LandingError

log = logging.getLogger(__name__)
ADMIT_RETRY_S = 0.005


class DecodeService:
    """Owns the HTTP routes of a decode instance, its landing arena and admission."""

    def __init__(
        self,
        name: str,
        host: EngineHost,
        arena: LandingArena,
        *,
        ranks: RankLandings,
        admit_timeout_s: float,
        landing_ttl_s: float,
        num_devices: int = 1,
    ) -> None:
        self.name = name
        self.host = host
        self.arena = arena
        """Rank 0's landing arena: it allocates one offset for every rank's buffer."""
        self.ranks = ranks
        self.admit_timeout_s = admit_timeout_s
        self.landing_ttl_s = landing_ttl_s
        self._admitted_at: dict[str, float] = {}
        self.kv_reporter = KVReporter(name, "decode", host, record_block_events=False)
        """GET /info and /kv_events (load only) for decode choice and the admission gate."""
        self.metrics = DecodeMetrics(name, host, arena, num_devices)
        self.registry = self.metrics.registry

    def status(self) -> InstanceStatus:
        """Engine thread."""
        e = self.host.engine
        return InstanceStatus(
            name=self.name,
            role="decode",
            healthy=True,
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_blocks_total=e.pool.num_blocks,
            kv_blocks_free=e.pool.num_free_blocks,
            landing_bytes_total=self.arena.total_bytes,
            landing_bytes_used=self.arena.used_bytes,
        )

    def app(self) -> FastAPI:
        app = base_app(self.host, self.status, self.registry, on_abort=self.free_landing)
        self.kv_reporter.install(app)
        app.post("/admit")(self.admit)
        app.post("/decode")(self.decode)
        return app

    def free_landing(self, request_id: str) -> None:
        self._admitted_at.pop(request_id, None)
        self.arena.free(request_id)

    async def reap_landing(self) -> None:
        """Free regions whose /decode never came (runs forever on the event loop)."""
        while True:
            await asyncio.sleep(min(5.0, self.landing_ttl_s))
            now = time.monotonic()
            for rid, t in list(self._admitted_at.items()):
                if now - t > self.landing_ttl_s:
                    log.warning("landing region of %s expired unused; freeing it", rid)
                    self.free_landing(rid)

    async def admit(self, request: Request) -> Response:
        msg = await read_message(request, AdmitRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, AdmitRequest)
        rid = msg.request_id
        try:
            await self.host.call(lambda e: e.check_fits(msg.num_prompt_tokens, msg.max_tokens))
            nbytes = self.ranks.region_bytes(msg.num_prompt_tokens)
            waited_from = time.monotonic()
            region = await asyncio.to_thread(self.arena.allocate, rid, nbytes, self.admit_timeout_s)
            self.metrics.landing_wait.observe(time.monotonic() - waited_from)
        except (PromptTooLongError, LandingTooLargeError) as e:
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        except LandingError as e:
            self.metrics.outcome("rejected")
            return error_response(409, str(e), rid)
        if region is None:
            self.metrics.outcome("no_landing")
            return error_response(
                503,
                f"decode instance {self.name} has no landing space free after "
                f"{self.admit_timeout_s:.0f}s; retry later",
                rid,
            )
        self._admitted_at[rid] = time.monotonic()
        infos = self.ranks.landing_infos(region)
        return json_response(AdmitResponse(request_id=rid, landing=infos))

    async def decode(self, request: Request) -> Response:
        msg = await read_message(request, DecodeRequest)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, DecodeRequest)
        rid = msg.request_id
        region = self.arena.region(rid)
        if region is None:
            self.metrics.outcome("rejected")
            return error_response(409, f"request {rid} holds no landing region: /admit first", rid)
        problem = check_flows(
            msg.segments,
            len(msg.prompt_token_ids),
            self.ranks.num_ranks,
            self.ranks.layout.num_layers,
        )
        if problem is not None:
            self.metrics.outcome("rejected")
            self.free_landing(rid)
            return error_response(400, f"bad KV segments for {rid}: {problem}", rid)

        def fill(kv_caches: list[torch.Tensor], table: list[BlockId]) -> None:
            started = time.perf_counter()
            self.ranks.scatter(region, msg.segments, kv_caches, list(table))
            self.metrics.scatter_seconds.observe(time.perf_counter() - started)

        def admit(e: LLMEngine) -> RequestOutput | None:
            return e.admit_prefilled(
                msg.prompt_token_ids,
                msg.first_token_id,
                msg.first_logprob,
                msg.params,
                rid,
                fill,
                msg.first_top_logprobs,
            )

        queue = self.host.open_stream(rid)
        deadline = time.monotonic() + self.admit_timeout_s
        try:
            while (first := await self.host.call(admit)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError
                await asyncio.sleep(ADMIT_RETRY_S)
        except (InvalidRequestError, PromptTooLongError) as e:
            self.host.close_stream(rid)
            self.free_landing(rid)
            self.metrics.outcome("rejected")
            return error_response(400, str(e), rid)
        except TimeoutError:
            self.host.close_stream(rid)
            self.free_landing(rid)
            self.metrics.outcome("no_kv")
            return error_response(
                503,
                f"decode instance {self.name} had no KV space for "
                f"{rid} within {self.admit_timeout_s:.0f}s",
                rid,
            )
        self.free_landing(rid)  # scattered into pages: the landing bytes are free again
        return StreamingResponse(self._events(rid, queue, first), media_type="application/x-ndjson")

    async def _events(self, rid: str, queue, first: RequestOutput) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
        finished = first.finished
        try:
            if finished:
                self.metrics.outcome("finished")
                yield encode_line(
                    TokenBatch(rid, [], [], first.finish_reason, first.num_output_tokens)
                )
                return
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                failure = next((i for i in items if isinstance(i, BaseException)), None)
                if failure is not None:
                    finished = True
                    self.metrics.outcome("failed")
                    yield encode_line(ErrorEvent(request_id=rid, status=500, message=str(failure)))
                    return
                outs = [i for i in items if isinstance(i, RequestOutput)]
                tokens = [t for o in outs for t in o.new_token_ids]
                logprobs = [lp for o in outs for lp in o.new_logprobs]
                tops = None
                if any(o.new_top_logprobs for o in outs):
                    tops = [
                        t
                        for o in outs
                        for t in (o.new_top_logprobs or [None] * len(o.new_token_ids))
                    ]
                finished = outs[-1].finished
                self.metrics.generated_tokens.inc(len(tokens))
                if finished:
                    self.metrics.outcome("finished")
                yield encode_line(
                    TokenBatch(
                        rid,
                        tokens,
                        logprobs,
                        outs[-1].finish_reason,
                        outs[-1].num_output_tokens,
                        top_logprobs=tops,
                    )
                )
        finally:
            self.host.close_stream(rid)
            if not finished:  # the router went away mid-stream: free the KV now
                self.metrics.outcome("aborted")
                await self.host.call(lambda e: e.abort(rid))

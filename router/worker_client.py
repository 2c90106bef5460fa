"""HTTP client side of the router <-> worker protocol (protocol/messages.py), typed errors out.

Endpoints the router calls (JSON bodies are the msgspec structs named):

    decode   POST /decode      DecodeRequest  -> 200 NDJSON stream of DecodeEvent:
                               DecodeReady first, then TokenBatch ...
    prefill  POST /prefill     PrefillRequest -> 200 NDJSON stream of PrefillEvent
             POST /landing     LandingGrant   -> 200 (decode's landing for a request sent
                                                 with await_landing)
             POST /admin/reset_prefix_cache   -> 200 (any JSON)
    unified  POST /generate    GenerateRequest -> 200 NDJSON stream of GenerateEvent:
                               FirstToken first, then TokenBatch ...
             POST /admin/reset_prefix_cache   -> 200 (any JSON)
    all      POST /abort       AbortRequest   -> 2xx (body ignored)
             GET  /health                     -> 200 when ready

Serving calls go over router/http1.py (keep-alive HTTP/1.1), control calls over httpx;
every call carries the cluster secret (protocol/internal_auth.py), and a worker's 401
(the router and the worker disagree on it) is a 502 naming the worker.
A non-2xx answer should carry an ErrorEvent body ({"type": "error", "status", "message",
"request_id"}); its status and message reach the client. Every call is bounded: connecting
by connect_timeout_s, the serving calls by the request's deadline (an event-loop time).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import httpx
import msgspec

from protocol.incarnation import HEADER as INCARNATION_HEADER
from protocol.internal_auth import auth_headers
from protocol.messages import (
    AbortRequest,
    DecodeEvent,
    DecodeRequest,
    ErrorEvent,
    GenerateEvent,
    GenerateRequest,
    LandingGrant,
    PrefillEvent,
    PrefillRequest,
    TokenBatch,
)
from router.errors import WorkerError, WorkerFailed, WorkerUnavailable
from router.http1 import ConnectFailed, ConnectionBroken, Http1Pool, Response
from router.instances import Instance

log = logging.getLogger(__name__)

DECODE_PATH = "/decode"
PREFILL_PATH = "/prefill"
LANDING_PATH = "/landing"
GENERATE_PATH = "/generate"
ABORT_PATH = "/abort"
HEALTH_PATH = "/health"
RESET_PREFIX_CACHE_PATH = "/admin/reset_prefix_cache"

_JSON_HEADERS = {"content-type": "application/json"}
_E = TypeVar("_E")
AbortReason = Literal["client_disconnected", "error", "timeout", "finished"]


class InstanceUnreachable(WorkerUnavailable):
    """503: connecting to `instance` failed, so it never saw the request (safe to retry)."""

    def __init__(self, instance: Instance, cause: Exception) -> None:
        super().__init__(f"{instance.describe()} is unreachable: {type(cause).__name__}: {cause}")
        self.instance = instance


class WorkerClient:
    """Owns the pooled HTTP connections to every worker. Runs on the router's event loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        control_timeout_s: float = 1.0,
        health_timeout_s: float = 1.0,
        cluster_secret: str | None = None,
    ) -> None:
        headers = auth_headers(cluster_secret)
        self._pool = Http1Pool(connect_timeout_s, headers)
        """The serving path (decode, prefill): see router/http1.py for why."""
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(control_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            trust_env=False,  # worker traffic never goes through a proxy
            headers=headers,
        )
        """Control calls: health, abort, admin."""
        self._control_timeout_s = control_timeout_s
        self._health_timeout_s = health_timeout_s
        self._prefill_decoder = msgspec.json.Decoder(PrefillEvent)
        self._decode_decoder = msgspec.json.Decoder(DecodeEvent)
        self._generate_decoder = msgspec.json.Decoder(GenerateEvent)
        self._background: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=self._control_timeout_s)
        await self._http.aclose()
        self._pool.close()

    # -- serving path ---------------------------------------------------------------------

    def prefill(
        self, inst: Instance, req: PrefillRequest, deadline: float
    ) -> AsyncIterator[PrefillEvent]:
        """The prefill instance's event stream for `req`."""
        return self._events(inst, PREFILL_PATH, req, self._prefill_decoder, deadline)

    def decode(
        self, inst: Instance, req: DecodeRequest, deadline: float
    ) -> AsyncIterator[DecodeEvent]:
        """The decode instance's event stream for `req` (DecodeReady first)."""
        return self._events(inst, DECODE_PATH, req, self._decode_decoder, deadline)

    def generate(
        self, inst: Instance, req: GenerateRequest, deadline: float
    ) -> AsyncIterator[GenerateEvent]:
        """A unified instance's event stream for `req` (FirstToken, then TokenBatch ...)."""
        return self._events(inst, GENERATE_PATH, req, self._generate_decoder, deadline)

    async def grant(self, inst: Instance, grant: LandingGrant, deadline: float) -> None:
        """POST /landing on the prefill instance: InstanceUnreachable when it never got
        the grant, WorkerError / WorkerFailed for its refusal or a broken connection."""
        try:
            resp = await self._pool.post(
                inst.url + LANDING_PATH, msgspec.json.encode(grant), deadline=deadline
            )
        except ConnectFailed as e:
            raise InstanceUnreachable(inst, e) from None
        except ConnectionBroken as e:
            raise _failed(inst, LANDING_PATH, e) from None
        try:
            if resp.status != 200:
                raise await self._refused(inst, LANDING_PATH, resp)
            await resp.read()
        except ConnectionBroken as e:
            raise _failed(inst, LANDING_PATH, e) from None
        finally:
            resp.close()

    def abort_soon(
        self,
        inst: Instance,
        request_id: str,
        reason: AbortReason,
        prefill_contacted: bool = True,
    ) -> None:
        """Send AbortRequest now without waiting for the answer (safe inside cancellation)."""
        task = asyncio.get_running_loop().create_task(
            self.abort(inst, request_id, reason, prefill_contacted)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(
        self,
        inst: Instance,
        request_id: str,
        reason: AbortReason,
        prefill_contacted: bool = True,
    ) -> None:
        """Tell `inst` to free `request_id`; failures are logged, never raised.
        `prefill_contacted` (decode): whether any prefill was sent the request."""
        msg = AbortRequest(
            request_id=request_id, reason=reason, prefill_contacted=prefill_contacted
        )
        body = msgspec.json.encode(msg)
        try:
            await self._http.post(
                inst.url + ABORT_PATH,
                content=body,
                headers=_JSON_HEADERS,
                timeout=self._control_timeout_s,
            )
        except httpx.HTTPError as e:
            log.warning("abort of %s on %s failed: %s", request_id, inst.describe(), e)

    # -- control ----------------------------------------------------------------------------

    async def health(self, inst: Instance) -> tuple[str | None, str]:
        """(None when GET /health answers 200, else what went wrong; the incarnation the
        worker named, "" if none)."""
        try:
            resp = await self._http.get(inst.url + HEALTH_PATH, timeout=self._health_timeout_s)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}", ""
        incarnation = resp.headers.get(INCARNATION_HEADER, "")
        if resp.status_code != 200:
            # A worker says why (enginehost/app.py: "engine loop stalled: ...", a lost
            # rank): the router's own /health and logs carry it on.
            why = resp.text.strip()[:200]
            error = f"GET /health answered {resp.status_code}"
            return (f"{error}: {why}" if why else error), incarnation
        return None, incarnation

    async def reset_prefix_cache(self, inst: Instance, timeout_s: float) -> tuple[int, Any]:
        """POST /admin/reset_prefix_cache: (status, JSON body or text); 503 when unreachable."""
        try:
            resp = await self._http.post(inst.url + RESET_PREFIX_CACHE_PATH, timeout=timeout_s)
        except httpx.HTTPError as e:
            return 503, f"{type(e).__name__}: {e}"
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    # -- plumbing ---------------------------------------------------------------------------

    async def _refused(self, inst: Instance, path: str, resp: Response) -> Exception:
        """The error a non-200 answer stands for, its body read (the caller raises it and
        closes `resp`)."""
        try:
            return _error_answer(inst, path, resp.status, await resp.read())
        except ConnectionBroken as e:
            return _failed(inst, path, e)

    async def _events(
        self,
        inst: Instance,
        path: str,
        msg: msgspec.Struct,
        decoder: msgspec.json.Decoder[_E],
        deadline: float,
    ) -> AsyncIterator[_E]:
        """Decoded NDJSON events of a streaming POST, each read bounded by `deadline`.
        TokenBatches that arrive in one socket read are yielded as one (see
        `merge_batches`)."""
        try:  # the POST (in this frame: a coroutine less per call)
            resp = await self._pool.post(
                inst.url + path, msgspec.json.encode(msg), deadline=deadline
            )  # `deadline` bounds its reading too
        except ConnectFailed as e:
            raise InstanceUnreachable(inst, e) from None
        except ConnectionBroken as e:
            raise _failed(inst, path, e) from None
        try:
            if resp.status != 200:
                raise await self._refused(inst, path, resp)
            pending = b""
            while True:
                data = resp.take()  # resp.read_some() inline: a coroutine less per read
                if data is None:
                    await resp.arrival()
                    continue
                if not data:
                    break
                pending += data
                # find, not `in`: bytes.__contains__ tries the operand as an integer
                # first and builds (then drops) a TypeError for every bytes operand.
                if data.find(b"\n") < 0:
                    continue
                *lines, pending = pending.split(b"\n")
                if len(lines) == 1:
                    line = lines[0]
                    if line.strip():
                        try:  # inline: a call less per read
                            event = decoder.decode(line)
                        except msgspec.DecodeError:
                            event = _decode_event(inst, decoder, line)  # raises, naming it
                        yield event
                    continue
                try:  # one comprehension over the read's lines, no call per line
                    decode = decoder.decode
                    events = [decode(line) for line in lines if line.strip()]
                except msgspec.DecodeError:  # again line by line, to name the bad one
                    events = [_decode_event(inst, decoder, line) for line in lines if line.strip()]
                for event in merge_batches(events):
                    yield event
            if pending.strip():
                yield _decode_event(inst, decoder, pending)
        except ConnectionBroken as e:
            raise _failed(inst, path, e) from None
        finally:
            resp.close()


def merge_batches(events: list[_E]) -> list[_E]:
    """`events` with consecutive TokenBatches of one request joined into one: the tokens
    a worker sent faster than the router read them pass the router's output path once,
    not once per batch. A worker's own TokenBatch already carries the tokens of every
    engine step it had pending when it wrote, so a joined batch says the same (tokens,
    logprobs and alternatives in order; the last batch's finish and count). Nothing is
    joined onto a batch that carries a finish_reason."""
    out: list[Any] = []
    run: list[TokenBatch] = []
    for event in events:
        if isinstance(event, TokenBatch):
            if run:
                prev = run[-1]
                if prev.finish_reason is None and prev.request_id == event.request_id:
                    run.append(event)
                    continue
                out.append(prev if len(run) == 1 else _join(run))
            run = [event]
            continue
        if run:
            out.append(run[0] if len(run) == 1 else _join(run))
            run = []
        out.append(event)
    if run:
        out.append(run[0] if len(run) == 1 else _join(run))
    return out


def _join(batches: list[TokenBatch]) -> TokenBatch:
    last = batches[-1]
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    for b in batches:  # the usual batches: logprobs aligned, no alternatives
        if b.top_logprobs is not None or len(b.logprobs) != len(b.token_ids):
            return _join_aligning(batches)
        token_ids += b.token_ids
        logprobs += b.logprobs
    return TokenBatch(
        last.request_id, token_ids, logprobs, last.finish_reason, last.num_output_tokens
    )


def _join_aligning(batches: list[TokenBatch]) -> TokenBatch:
    """`_join` for batches with alternatives, or with fewer logprobs than tokens."""
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    tops: list[list[tuple[int, float]] | None] | None = None
    if any(b.top_logprobs is not None for b in batches):
        tops = []
    for b in batches:
        n = len(b.token_ids)
        token_ids += b.token_ids
        # A worker may send fewer logprobs or alternatives than tokens: keep them aligned.
        lp = b.logprobs
        logprobs += lp if len(lp) == n else [*lp[:n], *[None] * (n - len(lp))]
        if tops is not None:
            top = b.top_logprobs or []
            tops += top if len(top) == n else [*top[:n], *[None] * (n - len(top))]
    last = batches[-1]
    return TokenBatch(
        last.request_id,
        token_ids,
        logprobs,
        last.finish_reason,
        last.num_output_tokens,
        top_logprobs=tops,
    )


def _decode_event(inst: Instance, decoder: msgspec.json.Decoder[_E], line: bytes) -> _E:
    try:
        return decoder.decode(line)
    except msgspec.DecodeError as e:
        raise WorkerFailed(
            f"{inst.describe()} sent an invalid event ({e}): {line[:200]!r}"
        ) from None


def _failed(inst: Instance, path: str, e: Exception) -> WorkerFailed:
    return WorkerFailed(
        f"{inst.describe()} failed during POST {path} "
        f"(the worker crashed or dropped the connection): {type(e).__name__}: {e}"
    )


def _error_answer(inst: Instance, path: str, status: int, body: bytes) -> Exception:
    """A worker's non-200 answer: its ErrorEvent when it sent one, else a 502."""
    if status == 401:
        return WorkerFailed(
            f"{inst.describe()} refused the router's call to {path} (401): the router and "
            "the worker do not share the cluster secret; restart the cluster with kvserve up"
        )
    try:
        event = msgspec.json.decode(body, type=ErrorEvent)
        return WorkerError(event.status, event.message)
    except msgspec.DecodeError:
        pass
    try:
        detail = msgspec.json.decode(body)
        if isinstance(detail, dict) and isinstance(detail.get("message"), str):
            return WorkerError(status, detail["message"])
    except msgspec.DecodeError:
        pass
    text = body[:300].decode("utf-8", "replace")
    return WorkerFailed(f"{inst.describe()} answered POST {path} with HTTP {status}: {text}")

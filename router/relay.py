"""One request's trip through a decode and a prefill instance: two worker calls, sent at
once (protocol 5).

    admit decode, pick prefill              both choices first
    ──DecodeRequest──▶ decode               pages reserved, landing ring allocated
    ──PrefillRequest(await_landing)──▶ prefill   at the same time: computes at once and
                                            keeps the KV (one task of the run)
                ◀─ DecodeReady              decode's landing; its stream stays open
    ──LandingGrant (POST /landing)──▶ prefill    the landing, forwarded: prefill's stages
                                            write the KV and tell decode directly
                ◀─ FirstToken               yielded once DecodeReady came and the grant
                                            was accepted (200)
                ◀─ TokenBatch ...           on decode's stream (yielded as they arrive)

max_tokens == 1: prefill alone, no landing. A grant answered 410 yields to prefill's own
answer (an error, or a first token that finished the request: nothing to hand over).

Retries: an instance that cannot be connected to never saw the request, so it is marked
unhealthy and another one is tried (a prefill retried after DecodeReady gets the landing
inline, no grant). Anything later is an error for the client.

Aborts (AbortRequest, sent in the background, never awaited):
- the run fails (client gone, worker error, timeout): every instance that was sent the
  request gets one, finished or not, so each frees whatever it still holds (decode is
  told whether a prefill was given its landing, by a grant or inline: if not, its
  landing ring is reused at once);
- the router finishes first (a stop string the worker has not matched yet, see
  `finish_early`): only the instances still working on it;
- prefill finishes at its first token: decode, to free the pages and landing it reserved.
A run that ends normally (a worker reported the finish) sends none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.messages import (
    PROTOCOL_VERSION,
    DecodeEvent,
    DecodeReady,
    DecodeRequest,
    ErrorEvent,
    FirstToken,
    LandingGrant,
    PrefillEvent,
    PrefillRequest,
    PromptUsage,
    TokenBatch,
)
from protocol.sampling import SamplingParams
from router.cluster_view import ClusterView
from router.errors import UpstreamTimeout, WorkerError, WorkerFailed, WorkerUnavailable
from router.instances import Instance, InstanceRegistry, Role
from router.policies import RouteContext, RoutingPolicy
from router.worker_client import AbortReason, InstanceUnreachable, WorkerClient

if TYPE_CHECKING:
    from router.admission import AdmissionGate, Reservation

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerTokens:
    """Tokens as a worker reported them; finish_reason is the worker's view."""

    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Per token, (token id, logprob) alternatives when the request asked for them."""


@dataclass
class RelayServices:
    """What every run shares: instances, policy, HTTP client, a decision hook, the view
    of KV and load the policy reads (updated here as requests are sent and answered),
    and the admission gate (None: no gate, as in tests of the relay alone)."""

    registry: InstanceRegistry
    policy: RoutingPolicy
    client: WorkerClient
    on_route: Callable[[Instance], None] = lambda _: None
    view: ClusterView = field(default_factory=ClusterView)
    gate: AdmissionGate | None = None


class RunEnd:
    """How a run ends, whatever its serving path: `_run` (every kind's) runs inside
    `with RunEnd(self):`. A run that did not complete (failed, timed out, closed before
    its finish: the client left) aborts every instance that was sent it, a timeout
    becomes UpstreamTimeout (504), and the decode reservation is released however it
    ends. A context manager, not a generator around `_run`: a streamed token passes one
    frame fewer."""

    __slots__ = ("run",)

    def __init__(self, run: RequestRun) -> None:
        self.run = run

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        run = self.run
        reason: AbortReason = "error"
        try:
            if exc_type is not None and issubclass(
                exc_type, (asyncio.CancelledError, GeneratorExit)
            ):
                reason = "client_disconnected"
            elif exc_type is not None and issubclass(exc_type, TimeoutError):
                reason = "timeout"
                raise UpstreamTimeout(
                    f"request {run.request_id} did not finish within {run.timeout_s:g} s "
                    "(router.request_timeout_s)"
                ) from None
        finally:
            if not run._completed:
                run.close(reason)
            run._closed = True
            if run._reservation is not None:
                run._reservation.release()


class RequestRun:
    """Owns one request's worker-side state: chosen instances, which of them still hold
    work, the prompt usage reported by prefill. `events()` may be iterated once."""

    def __init__(
        self,
        services: RelayServices,
        ctx: RouteContext,
        params: SamplingParams,
        timeout_s: float,
    ) -> None:
        self._s = services
        self.ctx = ctx
        self.params = params
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.timeout_s = timeout_s
        self.prefill: Instance | None = None
        self.decode: Instance | None = None
        self.usage: PromptUsage | None = None
        self._contacted: list[Instance] = []
        """Instances that were sent the request (abort targets on failure)."""
        self._open: list[Instance] = []
        """Instances still working on it (abort targets on an early finish)."""
        self._completed = False
        self._closed = False
        self._reservation: Reservation | None = None
        self._prefill_stream: AsyncIterator[PrefillEvent] | None = None
        """Prefill's event stream while it is open (`_open_prefill`)."""
        self._ready: DecodeReady | None = None
        """Decode's landing, once its DecodeReady came."""
        self._grant_to: Instance | None = None
        """The prefill instance sent the request with await_landing (the grant's target)."""
        self._landing_sent = False
        """A prefill was given decode's landing (a grant, or inline): it may write there."""

    @property
    def request_id(self) -> str:
        return self.ctx.request_id

    def events(self) -> AsyncGenerator[WorkerTokens, None]:
        """First token, then decode's token batches, until a worker reports a finish:
        the serving path itself (`_run`, which ends inside `RunEnd`: no generator frame
        around it). Closing it ends the run in the closing task (not in a task of the
        event loop's async-generator finalizer, one more task and a wake-up of the loop
        per request)."""
        return self._run()

    def close(self, reason: AbortReason) -> None:
        """The run failed: abort every instance that was sent it. Idempotent."""
        if not self._closed:
            self._closed = True
            for inst in self._contacted:
                self._s.client.abort_soon(inst, self.request_id, reason, self._landing_sent)

    def finish_early(self) -> None:
        """The router has its finish before the workers: stop those still working."""
        if not self._closed:
            self._closed = True
            for inst in self._open:
                self._s.client.abort_soon(inst, self.request_id, "finished")

    # -- the serving path -------------------------------------------------------------------

    async def _run(self) -> AsyncGenerator[WorkerTokens, None]:
        """The P/D serving path (subclasses serve other instance kinds, each inside
        `RunEnd` too). One frame from the worker streams to the caller: a streamed token
        passes this one and the worker client's; prefill's events are read here too
        (`_open_prefill`, `_read_prefill`: coroutines, no generator of their own)."""
        with RunEnd(self):
            decode_events: AsyncIterator[DecodeEvent] | None = None
            prefill_task: asyncio.Task[PrefillEvent | None] | None = None
            try:
                ready: DecodeReady | None = None
                refused: WorkerError | None = None
                if self.params.max_tokens > 1:
                    decode_inst = await self._admit_decode(set())
                    first_prefill = self._pick("prefill", set())
                    prefill_task = asyncio.create_task(self._open_prefill(first_prefill))
                    decode_events, ready = await self._open_decode(decode_inst)
                    self._ready = ready
                    target = self._grant_to
                    if target is not None:  # else the prefill had the landing inline
                        refused = await self._grant(target, ready)
                    assert self.decode is not None  # router/decode_bindings.py
                    bindings = self._s.registry.bindings
                    binding = bindings.bind(self.decode, ready.incarnation, self.request_id)
                    event = await binding.watch(_result(prefill_task))
                else:
                    event = await self._open_prefill(None)
                prefill = self.prefill
                first = None
                while event is not None:
                    if not isinstance(event, FirstToken):
                        raise WorkerError(event.status, event.message)
                    assert prefill is not None
                    if refused is not None and event.finish_reason is None:
                        raise WorkerFailed(
                            f"{_name(prefill)} refused decode's landing for the request "
                            f"({refused.status}): {refused.message}"
                        )
                    first = event
                    self.usage = event.usage
                    self._prefilled(prefill, event.usage)
                    self._done(prefill)
                    if event.finish_reason is not None:
                        self._release(self.decode)  # its pages and landing are not needed
                        self._completed = True
                    top: list[list[tuple[int, float]] | None] | None = None
                    if event.top_logprobs is not None:
                        top = [event.top_logprobs]
                    yield WorkerTokens([event.token_id], [event.logprob], event.finish_reason, top)
                    event = await self._read_prefill()
                self._done(prefill)
                if first is None:
                    raise WorkerFailed(f"{_name(prefill)} ended its stream without a FirstToken")
                if first.finish_reason is not None:
                    self._completed = True
                    return
                if decode_events is None:
                    raise WorkerFailed(f"{_name(prefill)} did not finish a max_tokens=1 request")
                decode = self.decode
                assert decode is not None
                incarnation = ready.incarnation if ready is not None else ""
                next_batch = decode_events.__anext__
                while True:
                    try:
                        batch = await next_batch()
                    except StopAsyncIteration:
                        break
                    except WorkerFailed as e:  # the worker broke mid-stream
                        self._broken(decode, e, incarnation)
                        raise
                    if isinstance(batch, ErrorEvent):
                        raise WorkerError(batch.status, batch.message)
                    if not isinstance(batch, TokenBatch):
                        raise WorkerFailed(f"{_name(decode)} sent a second DecodeReady")
                    finish = batch.finish_reason
                    if finish is not None:
                        self._done(decode)
                        self._completed = True
                    yield WorkerTokens(batch.token_ids, batch.logprobs, finish, batch.top_logprobs)
                    if finish is not None:
                        return
                raise WorkerFailed(f"{_name(decode)} ended its stream without a finish_reason")
            finally:
                try:
                    if prefill_task is not None:
                        await _settle(prefill_task)
                    if self._prefill_stream is not None:
                        await self._close_prefill()
                finally:
                    if decode_events is not None:
                        await decode_events.aclose()  # type: ignore[attr-defined]

    async def _grant(self, target: Instance, ready: DecodeReady) -> WorkerError | None:
        """Forward decode's landing to the prefill sent the request with await_landing.
        Returns a 410 answer (the request ended there: prefill's own answer decides
        what the client gets); a 5xx is the worker's own state (an engine stalled, an
        instance lost), passed on as prefill's errors are; any other refusal is the
        router's failure (502). An unreachable prefill never got the request either:
        its retry carries the landing inline."""
        grant = LandingGrant(PROTOCOL_VERSION, self.request_id, ready.landing, ready.notify_url)
        self._landing_sent = True
        try:
            await self._s.client.grant(target, grant, self.deadline)
        except InstanceUnreachable:
            return None
        except WorkerError as e:
            if e.status == 410:
                return e
            if e.status >= 500:
                raise
            raise WorkerFailed(
                f"{target.describe()} refused decode's landing for the request "
                f"({e.status}): {e.message}"
            ) from None
        return None

    async def _open_decode(self, inst: Instance) -> tuple[AsyncIterator[DecodeEvent], DecodeReady]:
        """Open decode's stream on `inst` (admitted; another one while one cannot be
        connected to) and read its DecodeReady (the request then waits there)."""
        req = DecodeRequest(
            version=PROTOCOL_VERSION,
            request_id=self.request_id,
            prompt_token_ids=list(self.ctx.prompt_token_ids),
            params=self.params,
        )
        tried: set[str] = set()
        while True:
            self._start(inst)
            events = self._s.client.decode(inst, req, self.deadline)
            try:
                first = await anext(aiter(events))
            except InstanceUnreachable as e:
                self._forget(inst, e, tried)
                if self._reservation is not None:
                    self._reservation.release()
                    self._reservation = None
                inst = await self._admit_decode(tried)
                continue
            except StopAsyncIteration:
                message = f"{inst.describe()} ended its stream before DecodeReady"
                self._s.registry.mark_unhealthy(inst, message)
                raise WorkerFailed(message) from None
            except WorkerFailed as e:
                self._s.registry.mark_unhealthy(inst, e.message)
                raise
            self.decode = inst
            if isinstance(first, ErrorEvent):
                await events.aclose()  # type: ignore[attr-defined]
                raise WorkerError(first.status, first.message)
            if not isinstance(first, DecodeReady):
                await events.aclose()  # type: ignore[attr-defined]
                raise WorkerFailed(f"{inst.describe()} sent tokens before DecodeReady")
            return events, first

    async def _admit_decode(self, tried: set[str]) -> Instance:
        """The decode instance for the request, through the admission gate if there is one."""
        gate = self._s.gate
        if gate is None:
            return self._pick("decode", tried)
        need = len(self.ctx.prompt_token_ids) + self.params.max_tokens

        def candidates() -> list[Instance]:
            return self._candidates("decode", tried)

        def choose(room: Sequence[Instance]) -> Instance:
            return self._choose("decode", room)

        # Most requests are admitted at once: no timeout scope (a timer) for those.
        reservation = gate.admit_now(self.request_id, need, candidates, choose)
        if reservation is None:
            async with asyncio.timeout_at(self.deadline):
                reservation = await gate.admit(self.request_id, need, candidates, choose)
        self._reservation = reservation
        return reservation.instance

    async def _open_prefill(self, inst: Instance | None) -> PrefillEvent | None:
        """Send prefill the request (on `inst`, or the policy's pick; another instance
        while one cannot be connected to) and read its first event (None: its stream
        ended). The stream stays open in `_prefill_stream` until `_close_prefill`.
        With decode in the run, before its DecodeReady: await_landing (the landing
        follows in a grant); after it: the landing inline."""
        view = self._s.view
        tried: set[str] = set()
        while True:
            if inst is None:
                inst = self._pick("prefill", tried)
            ready = self._ready
            awaits = self.params.max_tokens > 1 and ready is None
            req = PrefillRequest(
                version=PROTOCOL_VERSION,
                request_id=self.request_id,
                prompt_token_ids=list(self.ctx.prompt_token_ids),
                params=self.params,
                landing=ready.landing if ready is not None else [],
                notify_url=ready.notify_url if ready is not None else "",
                await_landing=awaits,
            )
            self._grant_to = inst if awaits else None
            self._landing_sent = self._landing_sent or ready is not None
            self.prefill = inst
            self._start(inst)
            n = self.ctx.predicted_compute_tokens
            view.on_prefill_sent(inst, self.request_id, n or len(self.ctx.prompt_token_ids))
            self._prefill_stream = self._s.client.prefill(inst, req, self.deadline)
            try:
                return await self._read_prefill()
            except InstanceUnreachable as e:  # it never got the request
                self._prefill_stream = None
                view.on_prefill_done(inst, self.request_id, [], None, None)
                self._forget(inst, e, tried)
                inst = None

    async def _read_prefill(self) -> PrefillEvent | None:
        """Prefill's next event, None at the stream's end."""
        assert self._prefill_stream is not None and self.prefill is not None
        try:
            return await anext(self._prefill_stream, None)
        except WorkerFailed as e:  # the worker broke mid-stream
            self._broken(self.prefill, e)
            raise

    async def _close_prefill(self) -> None:
        """Close prefill's stream if one is open; a prefill that never answered with its
        first token no longer counts as the instance's queued work."""
        events, self._prefill_stream = self._prefill_stream, None
        if events is None:
            return
        try:
            await events.aclose()  # type: ignore[attr-defined]
        finally:
            if self.usage is None and self.prefill is not None:
                self._s.view.on_prefill_done(self.prefill, self.request_id, [], None, None)

    def _prefilled(self, inst: Instance, usage: PromptUsage) -> None:
        """Prefill answered: its cache (and pool) now hold the prompt's full blocks."""
        st = self._s.view.state(inst)
        hashes = None
        if st.info is not None and st.root is not None:
            hashes = self.ctx.block_hashes(st.info.block_size, st.root)
        self._s.view.on_prefill_done(
            inst, self.request_id, self.ctx.prompt_token_ids, hashes, usage
        )

    def _broken(self, inst: Instance, error: WorkerFailed, incarnation: str = "") -> None:
        """`inst` broke mid-stream: unhealthy, unless the stream was `incarnation`'s and
        the instance has been restarted since (a decode stream sits unread while prefill
        works; its break may be old news)."""
        if not self._s.registry.mark_unhealthy(inst, error.message, incarnation):
            log.info(
                "%s: the stream of %s's previous process broke (%s); the restarted "
                "one stays routable",
                self.request_id,
                inst.describe(),
                error.message,
            )

    def _pick(self, role: Role, tried: set[str]) -> Instance:
        return self._choose(role, self._candidates(role, tried))

    def _candidates(self, role: Role, tried: set[str]) -> list[Instance]:
        candidates = self._s.registry.candidates(role, tried)
        if not candidates:
            total = len(self._s.registry.instances(role))
            raise WorkerUnavailable(
                f"no healthy {role} instance can take the request ({total} configured, "
                f"{len(tried)} tried for this request); retry shortly",
                code="no_healthy_instance",
                headers={"retry-after": "1"},
            )
        return candidates

    def _choose(self, role: Role, candidates: Sequence[Instance]) -> Instance:
        inst = self._s.policy.choose(role, self.ctx, candidates)
        self._s.on_route(inst)
        return inst

    def _forget(self, inst: Instance, error: InstanceUnreachable, tried: set[str]) -> None:
        """`inst` never got the request: mark it, don't abort it, try another."""
        self._s.registry.mark_unhealthy(inst, error.message)
        tried.add(inst.name)
        self._done(inst)
        self._contacted.remove(inst)

    def _start(self, inst: Instance) -> None:
        self._contacted.append(inst)
        self._open.append(inst)

    def _done(self, inst: Instance | None) -> None:
        if inst is not None and inst in self._open:
            self._open.remove(inst)

    def _release(self, inst: Instance | None) -> None:
        if inst is not None and inst in self._open:
            self._open.remove(inst)
            self._contacted.remove(inst)
            self._s.client.abort_soon(inst, self.request_id, "finished")


def _name(inst: Instance | None) -> str:
    return inst.describe() if inst is not None else "the instance"


async def _result(task: asyncio.Task[PrefillEvent | None]) -> PrefillEvent | None:
    """The task's result as a coroutine (a binding watches coroutines; cancelling this
    one cancels the task)."""
    return await task


async def _settle(task: asyncio.Task[PrefillEvent | None]) -> None:
    """Cancel the task if it still runs and wait for it; its error is the run's to
    raise elsewhere (or moot once the run failed)."""
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: the run already raised or returned

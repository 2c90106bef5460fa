"""EdgeControl: the control plane of the native data plane (docs/edge.md).

kvserve-edge (edge/) runs each plain request itself, as RequestRun (router/relay.py) and
UnifiedRun (router/unified.py) do, but every decision and every piece of shared state
stays here: the admission gate, the routing policy and the ClusterView it reads, instance
health and the decode bindings, the Prometheus metrics. The edge asks at relay.py's
decision points over one Unix socket (edge/src/control.rs is the client).

Wire: frames of a 4-byte little-endian length, then one JSON object.

    router -> edge, first frame   {"hello": {"version": 1, "topology": "pd" | "unified"}}
    edge -> router, asks (answered in a frame echoing "seq"):
      {"op": "admit", "seq", "id", "tried": [names], "deadline_s"}  -> {"seq", "instance"}
      {"op": "pick", "seq", "id", "role": "prefill" | "unified", "tried"}
                                                                    -> {"seq", "instance"}
      {"op": "ping", "seq"}                                         -> {"seq"}
      an ask that fails: {"seq", "error": {"status", "message", "type", "code",
                                          "headers": {name: value}}}
      "instance" is {"name", "url"}.
    edge -> router, reports (one-way, applied in order; a ping's answer means every
    earlier report was applied):
      {"op": "open", "id", "prompt": [ids], "max_tokens", "endpoint": "chat" |
       "completion", "user", "session"}    registers the request (one-way: the asks
                                           that follow are applied after it)
      {"op": "unreachable", "id", "instance": name, "message"}
      {"op": "bind", "id", "instance": name, "incarnation"}
      {"op": "prefilled", "id", "instance": name, "usage": PromptUsage}
      {"op": "broken", "id", "instance": name, "message", "incarnation"}
      {"op": "end", "id", "status", "prompt_tokens", "completion_tokens", "usage",
       "first_token_s", "last_token_s", "token_gaps_s"}          (times from arrival)
    router -> edge, pushed:
      {"lost": id, "error": {...}}   the decode process `id` is bound to is gone before
                                     prefill answered: the client gets `error` (503
                                     decode_instance_lost, retry-after), the run aborts
                                     its workers and ends as usual (a `lost` after the
                                     run reported `prefilled` is stale: ignore it)

Every ask is answered, an admission wait that `end` cut short too (an error), so the
client never holds a pending ask forever. A request's state (reservation, queued prefill
work, binding, in-flight gauge) lives from `open` to `end`; a connection that closes (the
edge died or was stopped) ends every request it opened, counted with status 500.
Runs on the router's event loop; one connection per edge process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec

from protocol.edge_messages import (
    DECODER,
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    WIRE_VERSION,
    Admit,
    Ask,
    Bind,
    Broken,
    End,
    Open,
    Pick,
    Ping,
    Prefilled,
    Unreachable,
    frame,
)
from router.admission import Reservation
from router.decode_bindings import Binding
from router.errors import APIError, UpstreamTimeout, WorkerUnavailable
from router.instances import Instance, Role
from router.metrics import RouterMetrics
from router.policies import RouteContext
from router.relay import RelayServices

log = logging.getLogger(__name__)

EDGE_GONE_STATUS = 500
"""How the requests of an edge connection that closed are counted."""


def _error_obj(e: APIError) -> dict[str, object]:
    return {
        "status": e.status,
        "message": e.message,
        "type": e.type,
        "code": e.code,
        "headers": e.headers,
    }


def _instance_obj(inst: Instance) -> dict[str, str]:
    return {"name": inst.name, "url": inst.url}


class _EdgeRequest:
    """One open request's bookkeeping: what RequestRun holds besides the worker streams."""

    __slots__ = (
        "admit_seq",
        "admitting",
        "binding",
        "ctx",
        "decode",
        "endpoint",
        "max_tokens",
        "opened_at",
        "prefill",
        "prefilled",
        "reservation",
    )

    def __init__(self, ctx: RouteContext, endpoint: str, max_tokens: int) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.max_tokens = max_tokens
        self.opened_at = time.monotonic()
        self.reservation: Reservation | None = None
        self.decode: Instance | None = None
        self.prefill: Instance | None = None
        """The prefill (or unified) instance counting the prompt as queued work."""
        self.prefilled = False
        self.binding: Binding | None = None
        self.admitting: asyncio.Task[None] | None = None
        """An admission wait in progress (cancelled by `end`)."""
        self.admit_seq = 0
        """The ask the admission wait answers (whoever cancels it answers it: a task
        cancelled before it ran has no chance to)."""


class EdgeControl:
    """Owns the control socket's server and every edge connection's open requests."""

    def __init__(
        self, services: RelayServices, metrics: RouterMetrics, *, request_timeout_s: float
    ) -> None:
        self.services = services
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.topology = "unified" if services.registry.instances("unified") else "pd"
        self._by_name = {i.name: i for i in services.registry.all()}
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None
        self.connections: set[_EdgeConnection] = set()

    async def start(self, path: str) -> None:
        """Listen on the Unix socket `path` (mode 0600; a stale socket file is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)  # before listen(): nobody else can connect meanwhile
        except BaseException:
            sock.close()
            raise
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _EdgeConnection(self), sock=sock)
        self._path = path

    async def stop(self) -> None:
        """Stop listening and close every connection (its requests end)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None

    def num_open(self) -> int:
        """Requests open on every connection (tests, the status page)."""
        return sum(len(c.requests) for c in self.connections)

    def instance(self, name: str) -> Instance | None:
        return self._by_name.get(name)


class _EdgeConnection(asyncio.Protocol):
    """One edge process's connection: reads frames, applies them, answers asks. Owns the
    requests that edge opened."""

    def __init__(self, control: EdgeControl) -> None:
        self.control = control
        self.services = control.services
        self.requests: dict[str, _EdgeRequest] = {}
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        """A frame's first part, until the rest arrives."""
        self._closed = False

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports (the router's loop) are not asyncio.Transport subclasses.
        self._transport = cast(asyncio.Transport, transport)
        self.control.connections.add(self)
        self._send({"hello": {"version": WIRE_VERSION, "topology": self.control.topology}})

    def data_received(self, data: bytes) -> None:
        if self._buf:  # the rest of a frame that came in pieces
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        view = memoryview(data)  # frames decoded in place, not copied
        start, end = 0, len(data)
        while end - start >= 4:
            (n,) = FRAME_HEADER.unpack_from(data, start)
            if n > MAX_FRAME_BYTES:
                log.error("edge control: a %d-byte frame; closing the connection", n)
                self.close()
                return
            if end - start - 4 < n:
                break
            self._apply(view[start + 4 : start + 4 + n])
            start += 4 + n
            if self._closed:
                return
        if start < end:
            self._buf += view[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_all()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._end_all()

    def _end_all(self) -> None:
        """The edge is gone: every request it opened ends (reservations released)."""
        self._closed = True
        self.control.connections.discard(self)
        requests, self.requests = self.requests, {}
        for req in requests.values():
            self._release(req)
            self._record(req, End(id=req.ctx.request_id, status=EDGE_GONE_STATUS))

    def _send(self, obj: object) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(obj))

    def _answer(self, seq: int, **fields: object) -> None:
        self._send({"seq": seq, **fields})

    def _fail(self, seq: int, error: APIError) -> None:
        self._send({"seq": seq, "error": _error_obj(error)})

    def _apply(self, body: memoryview) -> None:
        try:
            msg = DECODER.decode(body)
        except msgspec.DecodeError as e:
            self._malformed(bytes(body), e)
            return
        try:
            _HANDLERS[type(msg)](self, msg)
        except Exception as e:  # one request's failure, never the connection's
            error = e if isinstance(e, APIError) else None
            if error is None:
                log.exception("edge control: %s failed", type(msg).__name__)
                error = APIError(f"internal router error: {type(e).__name__}: {e}")
            if isinstance(msg, Ask):
                self._fail(msg.seq, error)
            else:
                log.warning("edge control: %s: %s", type(msg).__name__, error.message)

    def _malformed(self, body: bytes, error: msgspec.DecodeError) -> None:
        """A frame that is not one of the messages: an edge bug. Answer its ask if it
        carries a seq, so the edge's caller is not left waiting."""
        log.error("edge control: malformed message (%s): %.200r", error, body)
        try:
            seq = msgspec.json.decode(body, type=dict[str, object]).get("seq")
        except msgspec.DecodeError:
            return
        if isinstance(seq, int):
            self._fail(seq, APIError(f"internal router error: malformed control message: {error}"))

    def _request(self, request_id: str) -> _EdgeRequest:
        req = self.requests.get(request_id)
        if req is None:
            raise APIError(f"internal router error: request {request_id} is not open")
        return req

    def _resolve(self, req: _EdgeRequest, name: str) -> Instance:
        """The instance `name` as this request knows it (its decode or prefill)."""
        for inst in (req.decode, req.prefill):
            if inst is not None and inst.name == name:
                return inst
        inst = self.control.instance(name)
        if inst is None:
            raise APIError(f"internal router error: no instance named {name!r}")
        return inst

    # -- a request's start (a report: the asks that follow it need no answer to it) -------

    def _open(self, m: Open) -> None:
        """RequestRun's and RequestRecord's start: the request's route context (its block
        hashes come from the prompt's ids), in flight from now."""
        if m.id in self.requests:
            raise APIError(f"internal router error: request {m.id} is already open")
        if m.endpoint not in ("chat", "completion"):
            raise APIError(f"internal router error: unknown endpoint {m.endpoint!r}")
        ctx = RouteContext(m.id, m.prompt, m.user, m.session)
        self.requests[m.id] = _EdgeRequest(ctx, m.endpoint, m.max_tokens)
        self.control.metrics.in_flight.inc()

    # -- asks -------------------------------------------------------------------------------

    def _ping(self, m: Ping) -> None:
        self._answer(m.seq)

    def _admit(self, m: Admit) -> None:
        """relay.py `_admit_decode`: through the gate when there is one (at once when it
        can, else an admission wait in its own task, up to the run's deadline)."""
        req = self._request(m.id)
        self._stop_admitting(req)
        self._drop_reservation(req)
        tried = set(m.tried)
        gate = self.services.gate
        if gate is None:
            inst = self._choose("decode", req, tried)
            req.decode = inst
            self._answer(m.seq, instance=_instance_obj(inst))
            return
        need = len(req.ctx.prompt_token_ids) + req.max_tokens

        def candidates() -> list[Instance]:
            return self._candidates("decode", tried)

        def choose(room: Sequence[Instance]) -> Instance:
            return self._pick_of("decode", req, room)

        reservation = gate.admit_now(m.id, need, candidates, choose)
        if reservation is not None:
            self._reserved(m.seq, req, reservation)
            return
        req.admit_seq = m.seq
        req.admitting = asyncio.get_running_loop().create_task(
            self._admit_wait(m, req, need, candidates, choose)
        )

    async def _admit_wait(
        self,
        m: Admit,
        req: _EdgeRequest,
        need: int,
        candidates: Callable[[], list[Instance]],
        choose: Callable[[Sequence[Instance]], Instance],
    ) -> None:
        gate = self.services.gate
        assert gate is not None
        try:
            async with asyncio.timeout(max(0.0, m.deadline_s)):
                reservation = await gate.admit(m.id, need, candidates, choose)
        except TimeoutError:
            req.admitting = None
            self._fail(m.seq, self._timeout(m.id))
            return
        except APIError as e:
            req.admitting = None
            self._fail(m.seq, e)
            return
        except Exception as e:  # a router bug: the ask is still answered
            log.exception("edge control: admission of %s failed", m.id)
            req.admitting = None
            self._fail(m.seq, APIError(f"internal router error: {type(e).__name__}: {e}"))
            return
        # (cancelled: `_stop_admitting` answered the ask)
        req.admitting = None
        if self.requests.get(m.id) is not req:  # ended meanwhile
            reservation.release()
            return
        self._reserved(m.seq, req, reservation)

    def _timeout(self, request_id: str) -> UpstreamTimeout:
        """RunEnd's 504 for a run past its deadline (router/relay.py)."""
        return UpstreamTimeout(
            f"request {request_id} did not finish within {self.control.request_timeout_s:g} s "
            "(router.request_timeout_s)"
        )

    def _reserved(self, seq: int, req: _EdgeRequest, reservation: Reservation) -> None:
        req.reservation = reservation
        req.decode = reservation.instance
        self._answer(seq, instance=_instance_obj(reservation.instance))

    def _pick(self, m: Pick) -> None:
        """relay.py `_open_prefill` / unified.py: the instance, and the prompt counted as
        its queued work from now on."""
        req = self._request(m.id)
        if m.role not in ("prefill", "unified"):
            raise APIError(f"internal router error: cannot pick a {m.role!r} instance")
        role: Role = "prefill" if m.role == "prefill" else "unified"
        inst = self._choose(role, req, set(m.tried))
        self._forget_prefill(req)
        req.prefill = inst
        ctx = req.ctx
        n = ctx.predicted_compute_tokens or len(ctx.prompt_token_ids)
        self.services.view.on_prefill_sent(inst, ctx.request_id, n)
        self._answer(m.seq, instance=_instance_obj(inst))

    def _candidates(self, role: Role, tried: set[str]) -> list[Instance]:
        """relay.py `_candidates`, its 503 when no instance of `role` can take it."""
        registry = self.services.registry
        candidates = registry.candidates(role, tried)
        if not candidates:
            raise WorkerUnavailable(
                f"no healthy {role} instance can take the request "
                f"({len(registry.instances(role))} configured, {len(tried)} tried for this "
                "request); retry shortly",
                code="no_healthy_instance",
                headers={"retry-after": "1"},
            )
        return candidates

    def _choose(self, role: Role, req: _EdgeRequest, tried: set[str]) -> Instance:
        return self._pick_of(role, req, self._candidates(role, tried))

    def _pick_of(self, role: Role, req: _EdgeRequest, candidates: Sequence[Instance]) -> Instance:
        inst = self.services.policy.choose(role, req.ctx, candidates)
        self.services.on_route(inst)
        return inst

    # -- reports ----------------------------------------------------------------------------

    def _unreachable(self, m: Unreachable) -> None:
        """relay.py `_forget`: it never got the request."""
        req = self._request(m.id)
        inst = self._resolve(req, m.instance)
        if inst is req.prefill:
            self._forget_prefill(req)
        self.services.registry.mark_unhealthy(inst, m.message)
        if inst is req.decode:
            self._drop_reservation(req)
            req.decode = None

    def _bind(self, m: Bind) -> None:
        req = self._request(m.id)
        inst = self._resolve(req, m.instance)
        self._unbind(req)
        req.binding = self.services.registry.bindings.bind(inst, m.incarnation, m.id, self._on_lost)

    def _on_lost(self, binding: Binding) -> None:
        req = self.requests.get(binding.request_id)
        if req is None or req.binding is not binding:
            return
        req.binding = None
        self._send({"lost": binding.request_id, "error": _error_obj(binding.error())})

    def _prefilled(self, m: Prefilled) -> None:
        """relay.py `_prefilled`: its cache (and pool) now hold the prompt's full blocks."""
        req = self._request(m.id)
        inst = self._resolve(req, m.instance)
        self._unbind(req)
        if req.prefill is not inst:  # not the one it picked: that one's queued work ends
            self._forget_prefill(req)
        view = self.services.view
        st = view.state(inst)
        hashes = None
        if st.info is not None and st.root is not None:
            hashes = req.ctx.block_hashes(st.info.block_size, st.root)
        view.on_prefill_done(inst, m.id, req.ctx.prompt_token_ids, hashes, m.usage)
        req.prefilled = True

    def _broken(self, m: Broken) -> None:
        """relay.py `_broken`: unhealthy, unless a restarted process answers there now."""
        req = self._request(m.id)
        inst = self._resolve(req, m.instance)
        if inst is req.prefill:
            self._unbind(req)  # prefill's first event came: a failure
            self._forget_prefill(req)
        if not self.services.registry.mark_unhealthy(inst, m.message, m.incarnation):
            log.info(
                "%s: the stream of %s's previous process broke (%s); the restarted "
                "one stays routable",
                m.id,
                inst.describe(),
                m.message,
            )

    def _end(self, m: End) -> None:
        req = self.requests.pop(m.id, None)
        if req is None:
            log.warning("edge control: end of request %s, which is not open", m.id)
            return
        self._release(req)
        self._record(req, m)

    # -- a request's state --------------------------------------------------------------------

    def _release(self, req: _EdgeRequest) -> None:
        """Everything the request holds, given back (RunEnd and `_close_prefill`)."""
        self._stop_admitting(req)
        self._drop_reservation(req)
        self._unbind(req)
        self._forget_prefill(req)

    def _stop_admitting(self, req: _EdgeRequest) -> None:
        """Cut an admission wait short; its ask is answered with an error."""
        task, req.admitting = req.admitting, None
        if task is not None:
            task.cancel()
            rid = req.ctx.request_id
            self._fail(
                req.admit_seq, APIError(f"request {rid} ended while it waited for admission")
            )

    def _drop_reservation(self, req: _EdgeRequest) -> None:
        if req.reservation is not None:
            req.reservation.release()
            req.reservation = None

    def _unbind(self, req: _EdgeRequest) -> None:
        if req.binding is not None:
            req.binding.release()
            req.binding = None

    def _forget_prefill(self, req: _EdgeRequest) -> None:
        """A prefill that never answered no longer counts as its instance's queued work."""
        if req.prefill is not None and not req.prefilled:
            self.services.view.on_prefill_done(req.prefill, req.ctx.request_id, [], None, None)
        req.prefill = None

    def _record(self, req: _EdgeRequest, m: End) -> None:
        """RequestRecord.finish (router/metrics.py) from the edge's reported times."""
        metrics = self.control.metrics
        metrics.in_flight.dec()
        metrics.requests_of(req.endpoint, m.status).inc()
        if m.first_token_s is not None:
            metrics.ttft.observe(m.first_token_s)
        metrics.itl.observe_all(m.token_gaps_s)
        if m.status == 200:
            last = m.last_token_s
            metrics.e2e.observe(last if last is not None else time.monotonic() - req.opened_at)
        usage = m.usage
        if usage is not None:
            metrics.prompt_gpu.inc(max(0, usage.gpu_tokens))
            metrics.prompt_pool.inc(max(0, usage.pool_tokens))
            metrics.prompt_computed.inc(max(0, usage.computed_tokens))
        if m.completion_tokens > 0:
            metrics.generation_tokens.inc(m.completion_tokens)


_HANDLERS: dict[type, Callable[[_EdgeConnection, Any], None]] = {
    Open: _EdgeConnection._open,
    Admit: _EdgeConnection._admit,
    Pick: _EdgeConnection._pick,
    Ping: _EdgeConnection._ping,
    Unreachable: _EdgeConnection._unreachable,
    Bind: _EdgeConnection._bind,
    Prefilled: _EdgeConnection._prefilled,
    Broken: _EdgeConnection._broken,
    End: _EdgeConnection._end,
}
"""Each message's handler, by its type (one lookup a frame)."""

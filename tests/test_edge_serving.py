"""kvserve-edge's serving path (edge/src/serve.rs, relay.rs, worker.rs, proxy.rs) against
the real Python router and its stand-in workers (tests/router_standin.py): the edge in
front, the router behind it as the control plane (router/edge_control.py on a Unix
socket) and as the target of everything the edge proxies.

Each request is sent to the edge and to the Python router alone; the answers must be the
same bytes (the response id and `created` aside): completions and chat, streamed and
not, with usage; the proxied paths (/v1/models, /health, a tools request, a bad
request's 400, a wrong API key's 401). Then what only the edge's run does: a client that
leaves mid-stream aborts the workers; a prefill that refuses the connection is retried
on another."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from router_standin import NDJSON, RouterHarness, ServerThread, StandinWorker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from protocol.messages import FirstToken, GenerateRequest, PromptUsage, TokenBatch, encode_line
from router.config import InstanceEndpoint
from router.edge_control import EdgeControl

TEXT = "Hello world! The answer is 42."
API_KEY = "edge-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EdgeStack:
    """RouterHarness (the Python router over stand-ins), its EdgeControl on a Unix
    socket, and a kvserve-edge process in front of both."""

    def __init__(self, edge_bin: Path, tmp: Path, num_prefill: int = 1, **settings: Any) -> None:
        self.h = RouterHarness(num_prefill=num_prefill, api_key=API_KEY, **settings)
        self.extra: list[ServerThread] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: EdgeControl | None = None
        try:
            self._start(edge_bin, tmp)
        except BaseException:
            self.close()
            raise

    def _start(self, edge_bin: Path, tmp: Path) -> None:
        h = self.h
        serving = h.app.state.serving
        self.loop = h.router.server.servers[0].get_loop()
        self.control = EdgeControl(
            serving.services, h.app.state.metrics, request_timeout_s=serving.request_timeout_s
        )
        sock = str(tmp / "control.sock")
        asyncio.run_coroutine_threadsafe(self.control.start(sock), self.loop).result(10)
        tokenizer = tmp / "tokenizer.json"
        h.info.tokenizer.backend.save(str(tokenizer))
        port = _free_port()
        config = {
            "listen_host": "127.0.0.1",
            "listen_port": port,
            "python_url": h.url,
            "control_socket": sock,
            "tokenizer_path": str(tokenizer),
            "chat_template_path": self._chat_template(tmp),
            "served_model_names": [h.served_name],
            "eos_token_ids": list(h.info.eos_token_ids),
            "max_model_len": h.app.state.serving.preprocessor.context_len,
            "api_key": API_KEY,
            "session_headers": [n.lower() for n in h.settings.session_headers],
            "request_timeout_s": serving.request_timeout_s,
            "max_body_bytes": h.settings.http_limits.max_body_bytes,
            "worker_threads": 2,
        }
        path = tmp / "edge.json"
        path.write_text(json.dumps(config))
        self.stderr = open(tmp / "edge.stderr", "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(edge_bin), "serve", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.strip() == f"kvserve-edge listening on 127.0.0.1:{port}", line
        self.url = f"http://127.0.0.1:{port}"

    def _chat_template(self, tmp: Path) -> str | None:
        """The chat template as the edge's program of pieces, where this tree derives
        one (router/edge_template.py); None: chat requests are proxied."""
        try:
            from router.edge_template import derive_template, write_template
        except ImportError:
            return None
        program = derive_template(self.h.info.chat_template, self.h.info.tokenizer)
        if program is None:
            return None
        path = tmp / "chat_template.json"
        write_template(program, path)
        return str(path)

    def num_open(self) -> int:
        assert self.control is not None
        return self.control.num_open()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.stderr.close()
        if self.control is not None:
            asyncio.run_coroutine_threadsafe(self.control.stop(), self.loop).result(10)
        self.h.close()
        for server in self.extra:
            server.stop()


@pytest.fixture(scope="module")
def stack(edge_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeStack]:
    s = EdgeStack(edge_bin, tmp_path_factory.mktemp("edge"))
    yield s
    s.close()


@pytest.fixture
def s(stack: EdgeStack) -> EdgeStack:
    h = stack.h
    h.reset()
    h.set_output([*h.info.tokenizer.encode(TEXT), h.info.eos_token_ids[0]], usage_split=(8, 16))
    return stack


_ID = re.compile(rb'"id":"(cmpl|chatcmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')


def _normal(body: bytes) -> bytes:
    return _CREATED.sub(b'"created":0', _ID.sub(rb'"id":"\1-x"', body))


_TEXT_FIELD = re.compile(rb'("text":|"delta":\{"content":)("(?:[^"\\]|\\.)*")')


def _normal_stream(body: bytes) -> tuple[list[bytes], str]:
    """An SSE body as (its events with their text taken out, consecutive repeats once;
    the whole text): how the tokens fall into chunks depends on when they arrive, the
    bytes of every chunk around its text and the text itself do not."""
    events: list[bytes] = []
    text: list[str] = []

    def take(m: re.Match[bytes]) -> bytes:
        text.append(json.loads(m.group(2)))
        return b'"text":""' if m.group(1) == b'"text":' else b'"delta":{'

    for event in body.split(b"\n\n"):
        shape = _TEXT_FIELD.sub(take, _normal(event))
        if not events or events[-1] != shape:
            events.append(shape)
    return events, "".join(text)


def _both(s: EdgeStack, method: str, path: str, **kwargs: Any) -> tuple[Any, Any]:
    """The same request to the edge and to the Python router alone."""
    headers = {**AUTH, **kwargs.pop("headers", {})}
    with httpx.Client(trust_env=False, timeout=30) as client:
        edge = client.request(method, s.url + path, headers=headers, **kwargs)
        python = client.request(method, s.h.url + path, headers=headers, **kwargs)
    return edge, python


def _same(s: EdgeStack, method: str, path: str, **kwargs: Any) -> httpx.Response:
    edge, python = _both(s, method, path, **kwargs)
    assert edge.status_code == python.status_code, (edge.text, python.text)
    assert edge.headers.get("content-type") == python.headers.get("content-type")
    if edge.headers.get("content-type", "").startswith("text/event-stream"):
        assert _normal_stream(edge.content) == _normal_stream(python.content)
    else:
        assert _normal(edge.content) == _normal(python.content)
    return edge


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "smollm2-135m-instruct", "prompt": "Say it", "max_tokens": 64, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "What is the answer?"}]
    return {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 64, **extra}


def test_completions_are_the_routers_bytes(s: EdgeStack) -> None:
    r = _same(s, "POST", "/v1/completions", json=_completion())
    assert r.json()["choices"][0]["text"] == TEXT
    _same(s, "POST", "/v1/completions", json=_completion(prompt=[1, 2, 3], max_tokens=5))
    _same(s, "POST", "/v1/completions", json=_completion(stop=["answer"]))
    long = "The quick brown fox. " * 850  # 18 KB: tokenized off the runtime's loop
    _same(s, "POST", "/v1/completions", json=_completion(prompt=long))


def test_streamed_completions_are_the_routers_bytes(s: EdgeStack) -> None:
    r = _same(s, "POST", "/v1/completions", json=_completion(stream=True))
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.content.endswith(b"data: [DONE]\n\n")
    usage = {"include_usage": True}
    r = _same(s, "POST", "/v1/completions", json=_completion(stream=True, stream_options=usage))
    assert b'"usage":{"prompt_tokens"' in r.content


def test_chat_is_the_routers_bytes(s: EdgeStack) -> None:
    r = _same(s, "POST", "/v1/chat/completions", json=_chat())
    assert r.json()["choices"][0]["message"]["content"] == TEXT
    usage = {"include_usage": True}
    _same(s, "POST", "/v1/chat/completions", json=_chat(stream=True, stream_options=usage))


def test_max_tokens_one_and_a_first_token_finish(s: EdgeStack) -> None:
    _same(s, "POST", "/v1/completions", json=_completion(max_tokens=1))
    s.h.set_output([s.h.info.eos_token_ids[0], 100])
    _same(s, "POST", "/v1/completions", json=_completion(max_tokens=5))


def _edge_rid(s: EdgeStack) -> str:
    """The id of the edge's request (the first the decode stand-in was sent)."""
    return str(s.h.decode[0].received[0][1].request_id)


def test_prefill_computes_while_decode_reserves(s: EdgeStack) -> None:
    """Protocol 5, as the Python router runs it: decode and prefill (await_landing) at
    once, DecodeReady forwarded as a LandingGrant, the first token once it is accepted."""
    prefill, decode = s.h.prefill[0], s.h.decode[0]
    decode.ready_delay_s = 0.3
    req = _completion(stream=True)
    with (
        httpx.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", s.url + "/v1/completions", json=req, headers=AUTH) as r,
    ):
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(lines)
        first_at = time.monotonic()
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
    assert "server" not in r.headers  # served natively (a proxied answer: uvicorn's)
    rid = _edge_rid(s)
    ((kind, sent),) = prefill.received
    assert kind == "prefill" and sent.request_id == rid
    assert sent.await_landing and sent.landing == [] and sent.notify_url == ""
    assert prefill.arrivals["prefill", rid] < decode.readies[rid] - 0.2
    (grant,) = prefill.landings
    assert grant.request_id == rid and len(grant.landing) == 1
    assert grant.notify_url.endswith("/kv_notify")
    assert first_at >= prefill.arrivals["landing", rid] >= decode.readies[rid]
    assert TEXT.endswith(text) and text
    _same(s, "POST", "/v1/completions", json=_completion())  # the same answer as Python's


def test_the_grant_does_not_wait_for_prefills_answer(s: EdgeStack) -> None:
    """A prefill that answers (headers and all) only with its first token: the grant
    still goes out on DecodeReady, while prefill computes."""
    prefill = s.h.prefill[0]
    prefill.prefill_delay_s, prefill.prefill_answers_late = 0.4, True
    r = _same(s, "POST", "/v1/completions", json=_completion())
    assert r.json()["choices"][0]["text"] == TEXT
    rid = _edge_rid(s)
    assert prefill.arrivals["landing", rid] < prefill.arrivals["prefill", rid] + 0.3


@pytest.mark.parametrize(
    "fail", [(403, "landing refused: altered"), (410, "gone"), (503, "engine loop stalled")]
)
def test_a_refused_grant_is_the_routers_answer(s: EdgeStack, fail: tuple[int, str]) -> None:
    s.h.prefill[0].fail = {"landing": fail}
    r = _same(s, "POST", "/v1/completions", json=_completion())
    assert r.status_code == (503 if fail[0] == 503 else 502), r.text
    assert fail[1] in r.json()["error"]["message"]
    rid = _edge_rid(s)
    _wait_for(lambda: rid in s.h.prefill[0].aborted_ids() and rid in s.h.decode[0].aborted_ids())
    (abort,) = [a for _, a in s.h.decode[0].aborts if a.request_id == rid]
    assert abort.prefill_contacted  # the grant went out


def test_decode_refusing_tells_it_no_prefill_writes(s: EdgeStack) -> None:
    s.h.decode[0].fail = {"decode": (503, "decode is draining")}
    r = _same(s, "POST", "/v1/completions", json=_completion())
    assert r.status_code == 503
    rid = _edge_rid(s)
    _wait_for(lambda: rid in s.h.prefill[0].aborted_ids())
    assert not s.h.prefill[0].landings


def test_proxied_paths_are_the_routers_answers(s: EdgeStack) -> None:
    _same(s, "GET", "/v1/models")
    _same(s, "GET", "/health")
    bad = _same(s, "POST", "/v1/completions", json=_completion(max_tokens=-1))
    assert bad.status_code == 400
    _same(s, "POST", "/v1/completions?x=1", json=_completion())
    _same(s, "POST", "/v1/completions", content=b"{not json")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    _same(s, "POST", "/v1/chat/completions", json=_chat(tools=tools))
    wrong = _same(s, "POST", "/v1/completions", json=_completion(), headers={"authorization": "x"})
    assert wrong.status_code == 401
    assert _same(s, "GET", "/nowhere").status_code == 404


def test_a_body_over_the_limit_is_the_routers_413(s: EdgeStack) -> None:
    limit = s.h.settings.http_limits.max_body_bytes
    big = json.dumps(_completion(prompt="x" * (limit + 10))).encode()
    with httpx.Client(trust_env=False, timeout=30) as client:
        declared = client.post(s.url + "/v1/completions", content=big, headers=AUTH)
        chunked = client.post(
            s.url + "/v1/completions", content=iter([big[:1000], big[1000:]]), headers=AUTH
        )
    assert declared.status_code == chunked.status_code == 413


def test_worker_errors_are_the_routers_answers(s: EdgeStack) -> None:
    s.h.prefill[0].fail = {"prefill": (400, "prompt too long for this worker")}
    r = _same(s, "POST", "/v1/completions", json=_completion())
    assert r.status_code == 400
    s.h.reset()
    s.h.decode[0].fail = {"decode": (503, "decode is draining")}
    assert _same(s, "POST", "/v1/chat/completions", json=_chat(stream=True)).status_code == 503


def test_a_decode_lost_while_prefill_works_is_the_routers_503(s: EdgeStack) -> None:
    h = s.h
    h.set_output([100, 101, 102], prefill_delay_s=2)
    registry = h.app.state.registry
    d0 = next(i for i in registry.all() if i.name == "d0")

    def lose() -> None:  # on the router's loop, as its health checks would
        s.loop.call_soon_threadsafe(registry.mark_unhealthy, d0, "the process exited")

    with httpx.Client(trust_env=False, timeout=30) as client:
        timer = threading.Timer(0.3, lose)
        timer.start()
        r = client.post(s.url + "/v1/completions", json=_completion(), headers=AUTH)
        timer.join()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "decode_instance_lost"
    assert r.headers["retry-after"] == "1"
    rid = h.decode[0].received[0][1].request_id
    _wait_for(lambda: rid in h.prefill[0].aborted_ids() and rid in h.decode[0].aborted_ids())
    _wait_for(lambda: s.num_open() == 0)


def test_a_stop_string_ends_the_request_and_stops_the_workers(s: EdgeStack) -> None:
    r = _same(s, "POST", "/v1/completions", json=_completion(stop=[" answer"]))
    assert r.json()["choices"][0]["text"] == "Hello world! The"
    _same(s, "POST", "/v1/completions", json=_completion(stop=[" answer"], stream=True))
    rid = s.h.decode[0].received[0][1].request_id  # the edge's (sent first)
    _wait_for(lambda: rid in s.h.decode[0].aborted_ids())
    assert {a.reason for _, a in s.h.decode[0].aborts if a.request_id == rid} == {"finished"}


def test_a_decode_that_breaks_mid_stream_is_an_error_event(s: EdgeStack) -> None:
    h = s.h
    h.set_output(list(range(100, 110)), crash_decode_after=3)
    with httpx.Client(trust_env=False, timeout=30) as client:
        body = _completion(stream=True)
        r = client.post(s.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200
    *_, error, done = r.content.split(b"\n\n")[:-1]
    assert done == b"data: [DONE]"
    err = json.loads(error.removeprefix(b"data: "))["error"]
    assert err["type"] == "server_error" and "failed during POST /decode" in err["message"]
    d0 = next(i for i in h.app.state.registry.all() if i.name == "d0")
    _wait_for(lambda: "failed during POST /decode" in (d0.last_error or ""))  # `broken`
    _wait_for(lambda: s.num_open() == 0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_stream_aborts_the_workers(s: EdgeStack, path: str) -> None:
    h = s.h
    h.set_output(list(range(100, 400)), token_delay_s=0.02)
    with httpx.Client(trust_env=False, timeout=30) as client:
        make = _completion if path == "/v1/completions" else _chat
        body = make(stream=True, max_tokens=300)
        with client.stream("POST", s.url + path, json=body, headers=AUTH) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()  # held: a dropped iterator closes the connection
            next(chunks)
            assert s.num_open() == 1  # served by the edge: its run is open in the control plane
    _wait_for(lambda: len(h.decode[0].received) == 1)
    rid = h.decode[0].received[0][1].request_id
    # its own abort (an earlier test's late abort may be in the list too)
    _wait_for(lambda: any(a.request_id == rid for _, a in h.decode[0].aborts))
    reasons = {a.reason for _, a in h.decode[0].aborts if a.request_id == rid}
    assert reasons == {"client_disconnected"}
    _wait_for(lambda: rid in h.prefill[0].aborted_ids())  # sent at once, in the background
    _wait_for(lambda: s.num_open() == 0)


def test_a_refused_prefill_is_retried_on_another(edge_bin: Path, tmp_path: Path) -> None:
    st = EdgeStack(edge_bin, tmp_path, num_prefill=2)
    try:
        h = st.h
        h.set_output([*h.info.tokenizer.encode(TEXT), h.info.eos_token_ids[0]])
        h.worker_servers[0].stop()  # p0's port now refuses connections
        with httpx.Client(trust_env=False, timeout=30) as client:
            for _ in range(4):
                r = client.post(st.url + "/v1/completions", json=_completion(), headers=AUTH)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == TEXT
        registry = h.app.state.registry
        p0 = next(i for i in registry.all() if i.name == "p0")
        assert not p0.healthy
        assert len(h.prefill[1].received) == 4
    finally:
        st.close()


def test_a_request_past_request_timeout_s_is_a_504(edge_bin: Path, tmp_path: Path) -> None:
    st = EdgeStack(edge_bin, tmp_path, request_timeout_s=0.5)
    try:
        st.h.set_output([100, 101, 102], prefill_delay_s=3)
        edge, python = _both(st, "POST", "/v1/completions", json=_completion())
        assert edge.status_code == python.status_code == 504
        error = edge.json()["error"]
        assert error["type"] == "timeout"
        assert re.fullmatch(
            r"request cmpl-[0-9a-f]+ did not finish within 0.5 s \(router.request_timeout_s\)",
            error["message"],
        )
        assert _normal(edge.content).replace(edge.json()["error"]["message"].encode(), b"") == (
            _normal(python.content).replace(python.json()["error"]["message"].encode(), b"")
        )
        rid = st.h.prefill[0].received[0][1].request_id
        _wait_for(lambda: rid in st.h.prefill[0].aborted_ids())
        _wait_for(lambda: st.num_open() == 0)
    finally:
        st.close()


def test_sigterm_lets_in_flight_requests_finish(edge_bin: Path, tmp_path: Path) -> None:
    st = EdgeStack(edge_bin, tmp_path)
    try:
        st.h.set_output(list(range(100, 150)), token_delay_s=0.01)
        assert st.proc is not None
        with httpx.Client(trust_env=False, timeout=30) as client:
            body = _completion(stream=True, max_tokens=50)
            with client.stream("POST", st.url + "/v1/completions", json=body, headers=AUTH) as r:
                chunks = r.iter_bytes()
                got = [next(chunks)]
                st.proc.terminate()
                got += list(chunks)
        assert b"".join(got).endswith(b"data: [DONE]\n\n")
        assert b'"finish_reason":"length"' in b"".join(got)
        assert st.proc.wait(10) == 0
    finally:
        st.close()


def test_the_edge_exits_when_the_control_socket_closes(edge_bin: Path, tmp_path: Path) -> None:
    st = EdgeStack(edge_bin, tmp_path)
    try:
        assert st.proc is not None and st.control is not None
        asyncio.run_coroutine_threadsafe(st.control.stop(), st.loop).result(10)
        assert st.proc.wait(10) != 0  # the router restarts it
    finally:
        st.close()


class UnifiedStandin(StandinWorker):
    """A stand-in unified instance: POST /generate answers FirstToken (tokens[0]), then
    the other tokens one TokenBatch each, with the stand-ins' finish rules."""

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes.append(Route("/generate", self._generate, methods=["POST"]))
        return app

    async def _generate(self, request: Request) -> Response:
        req = msgspec.json.decode(await request.body(), type=GenerateRequest)
        self.received.append(("generate", req))
        n = len(req.prompt_token_ids)
        usage = PromptUsage(prompt_tokens=n, gpu_tokens=0, pool_tokens=0, computed_tokens=n)
        params = req.params

        async def events() -> Any:
            count = 1
            finish = self._finish(self.tokens[0], 1, params.max_tokens, params.ignore_eos)
            yield encode_line(
                FirstToken(
                    request_id=req.request_id,
                    token_id=self.tokens[0],
                    logprob=None,
                    usage=usage,
                    finish_reason=finish,
                )
            )
            for i, token in enumerate(self.tokens[1:]):
                if finish is not None or req.request_id in self.aborted_ids():
                    return
                count += 1
                finish = self._finish(token, count, params.max_tokens, params.ignore_eos)
                if i == len(self.tokens) - 2 and finish is None:
                    finish = "length"
                batch = TokenBatch(req.request_id, [token], [None], finish, count)
                yield encode_line(batch)

        return StreamingResponse(events(), media_type=NDJSON)


def test_a_unified_cluster_is_served_in_one_call(edge_bin: Path, tmp_path: Path) -> None:
    worker = UnifiedStandin()
    server = ServerThread(worker.app())
    server.start()
    try:
        unified = (InstanceEndpoint(name="u0", url=server.url),)
        st = EdgeStack(edge_bin, tmp_path, num_prefill=0, num_decode=0, unified=unified)
    except BaseException:
        server.stop()
        raise
    st.extra.append(server)
    try:
        h = st.h
        worker.tokens = [*h.info.tokenizer.encode(TEXT), h.info.eos_token_ids[0]]
        r = _same(st, "POST", "/v1/completions", json=_completion())
        assert r.json()["choices"][0]["text"] == TEXT
        usage = {"include_usage": True}
        _same(st, "POST", "/v1/chat/completions", json=_chat(stream=True, stream_options=usage))
        _same(st, "POST", "/v1/completions", json=_completion(max_tokens=1))
        kinds = {kind for kind, _ in worker.received}
        assert kinds == {"generate"} and len(worker.received) == 6  # 3 each: edge, router
        _wait_for(lambda: st.num_open() == 0)
    finally:
        st.close()


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `cond` holds; the bound is generous (a loaded 2-core machine runs the suite),
    and a miss names the condition."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not met within {timeout_s:g} s: {cond.__code__}"
        time.sleep(0.01)

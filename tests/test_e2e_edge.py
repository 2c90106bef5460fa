"""End to end, the native data plane: `kvserve up` of a real prefill and a real decode
worker serving the builtin SmolLM2-135M in float32 on CPU, and the real router with
`router.data_plane: native` (the router starts kvserve-edge on router.port and serves as
its control plane, docs/edge.md).

Every request is sent twice: to router.port, where the edge serves it, and to the
router's internal listener (the `python_url` of the edge's config), where the Python
data plane serves it against the same workers, admission and policy. Greedy outputs
(completions and chat, streamed and not, stop strings, max_tokens 1, a second chat turn
that reuses the first's KV) are the same both ways and equal the single-process engine's;
a client that leaves mid-stream leaves no work on the workers; a prefill killed while the
edge serves gives the same error both ways.

Which requests the edge served itself is told by the `server` header: the router's
HTTP server (uvicorn) writes one on every answer, which the edge passes on unchanged
when it proxies a request; a native answer has none.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import torch
from cluster_harness import Cluster, start_cluster, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
MODEL = "builtin:smollm2-135m-instruct"
SERVED = "e2e-model"


class EdgeCluster(Cluster):
    python_url: str
    """The router's internal listener: the Python data plane of the same cluster."""


def _edge_config(router_pid: int) -> dict:
    """The edge's config file (router/edge.py writes it), found through the edge
    process the router started as its child."""
    for task in Path(f"/proc/{router_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if any(a.endswith(b"kvserve-edge") for a in argv[:1]) and b"--config" in argv:
                path = argv[argv.index(b"--config") + 1].decode()
                return dict(json.loads(Path(path).read_text()))
    raise AssertionError(f"no kvserve-edge child of the router (pid {router_pid})")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, weights_cache_dir: str, edge_bin: Path):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e-edge"),
        MODEL,
        cache_dir=weights_cache_dir,
        name="e2e-edge",
        router={"data_plane": "native", "request_timeout_s": 120},
    )
    try:
        ec = EdgeCluster(**c.__dict__)
        ec.python_url = _edge_config(c.pids()["router"])["python_url"]
        yield ec
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(MODEL, EngineConfig(cache_dir=weights_cache_dir, dtype="float32"))


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1" + path, json=body, timeout=120, trust_env=False)


def _answer(base: str, path: str, body: dict) -> dict:
    """What a client sees of one request: status, the text(s), finish reasons and usage
    (ids and timestamps left out; a stream's chunks joined), and the `server` header."""
    if not body.get("stream"):
        r = _post(base, path, body)
        out = r.json()
        server = r.headers.get("server")
        if r.status_code != 200:
            return {"status": r.status_code, "error": out["error"], "server": server}
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {
            "status": 200,
            "text": text,
            "finish": choice["finish_reason"],
            "usage": out["usage"],
            "server": server,
        }
    text, finish, usage = [], [], None
    with httpx.stream("POST", base + "/v1" + path, json=body, timeout=120, trust_env=False) as r:
        server = r.headers.get("server")
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.json()["error"], "server": server}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                text.append(delta)
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
            usage = chunk.get("usage") or usage
    out = {"status": 200, "text": "".join(text), "finish": finish[-1:], "usage": usage}
    return dict(out, server=server)


def _both(c: EdgeCluster, path: str, body: dict) -> dict:
    """The answer through the edge, checked equal to the Python data plane's (the prompt
    is then in the prefill's cache: the Python answer's usage details may differ there)
    and served by the edge itself (no `server` header: not proxied)."""
    native = _answer(c.router_url, path, body)
    python = _answer(c.python_url, path, body)
    assert native.pop("server") is None, "the edge proxied the request"
    assert python.pop("server") == "uvicorn"
    for got in (native, python):
        if got.get("usage"):
            got["usage"].pop("prompt_tokens_details", None)
    assert native == python
    return native


def _words(seed: int, n: int) -> str:
    vocab = ["agent", "tool", "cache", "token", "block", "router", "decode", "prefill", "pool"]
    return " ".join(vocab[(seed * 7 + i * 3 + i // 5) % len(vocab)] for i in range(n))


def _greedy(ref: LLMEngine, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = ref.generate([ids], params)[0]
    return out.token_ids, out.text


def _chat_ids(ref: LLMEngine, messages: list[dict]) -> list[int]:
    text = ref.info.chat_template.render(messages, add_generation_prompt=True)
    return list(ref.info.tokenizer.encode(text, add_special_tokens=False))


def test_the_server_header_tells_proxied_from_native(cluster):
    """The signal the tests read: what the edge proxies carries uvicorn's header."""
    r = httpx.get(cluster.api_base + "/models", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.headers.get("server") == "uvicorn"
    bad = _post(cluster.router_url, "/completions", {"model": SERVED, "prompt": "x", "n": 17})
    assert bad.status_code == 400 and bad.headers.get("server") == "uvicorn"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_is_native_and_exact(cluster, reference, stream):
    prompt = f"Session {int(stream)}: {_words(1 + int(stream), 40)}"
    ids = reference.info.tokenizer.encode(prompt)
    _, want = _greedy(reference, ids, 16)
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    got = _both(cluster, "/completions", {k: v for k, v in body.items() if v is not None})
    assert got["text"] == want and got["finish"] in ("length", ["length"])
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert got["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("stream", [False, True])
def test_chat_is_native_and_exact(cluster, reference, stream):
    messages = [{"role": "user", "content": f"Tell me about {_words(3 + int(stream), 12)}."}]
    ids = _chat_ids(reference, messages)
    _, want = _greedy(reference, ids, 20)
    body: dict = {"model": SERVED, "messages": messages, "max_tokens": 20, "temperature": 0}
    body.update(ignore_eos=True, stream=stream)
    got = _both(cluster, "/chat/completions", body)
    assert got["text"] == want


def test_stop_string_and_one_token(cluster, reference):
    prompt = f"Session 9: {_words(9, 30)}"
    ids = reference.info.tokenizer.encode(prompt)
    _, want = _greedy(reference, ids, 24)
    # a stop string from the middle of the greedy text: the output ends just before it
    stop = want[len(want) // 2 : len(want) // 2 + 4]
    assert stop.strip(), want
    for stream in (False, True):
        body = {"model": SERVED, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        body.update(ignore_eos=True, stream=stream, stop=[stop])
        got = _both(cluster, "/completions", body)
        assert got["text"] == want[: want.index(stop)]
        assert got["finish"] in ("stop", ["stop"])
        one = dict(body, max_tokens=1, stop=None)
        got = _both(cluster, "/completions", {k: v for k, v in one.items() if v is not None})
        assert got["text"] == _greedy(reference, ids, 1)[1]
        assert got["finish"] in ("length", ["length"])


def test_second_chat_turn_reuses_the_first(cluster, reference):
    first = [{"role": "user", "content": f"Write about {_words(21, 60)}."}]
    reply = _both(
        cluster,
        "/chat/completions",
        {"model": SERVED, "messages": first, "max_tokens": 12, "temperature": 0},
    )
    assert reply["text"] == _greedy(reference, _chat_ids(reference, first), 12)[1]
    second = [
        *first,
        {"role": "assistant", "content": reply["text"]},
        {"role": "user", "content": "And then?"},
    ]
    ids = _chat_ids(reference, second)
    body = {"model": SERVED, "messages": second, "max_tokens": 12, "temperature": 0}
    native = _answer(cluster.router_url, "/chat/completions", body)
    assert native["text"] == _greedy(reference, ids, 12)[1]
    details = native["usage"]["prompt_tokens_details"]
    # the first turn's whole blocks came from the prefill's cache
    assert details["gpu_tokens"] >= len(_chat_ids(reference, first)) // 16 * 16 - 16
    assert details["gpu_tokens"] > 0
    assert details["gpu_tokens"] + details["pool_tokens"] + details["computed_tokens"] == len(ids)


def test_client_leaving_mid_stream_aborts_the_workers(cluster, reference):
    body = {
        "model": SERVED,
        "prompt": _words(5, 50),
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", cluster.api_base + "/completions", json=body, timeout=60, trust_env=False
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers.get("server") is None
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert cluster.status(cluster.decode_url)["num_running"] == 1
    assert wait_until(cluster.idle, timeout_s=10.0)
    prompt = f"Session 6: {_words(6, 20)}"
    want = _greedy(reference, reference.info.tokenizer.encode(prompt), 8)[1]
    got = _both(
        cluster,
        "/completions",
        {"model": SERVED, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert got["text"] == want


@pytest.mark.slow
def test_reference_is_transformers_greedy(reference, smollm2_hf):
    """The single-process engine's tokens the tests above compare with are transformers'
    float32 greedy choice (teacher-forced)."""
    ids = reference.info.tokenizer.encode(f"Session 1: {_words(1, 40)}")
    out, _ = _greedy(reference, ids, 16)
    with torch.no_grad():
        logits = smollm2_hf[1](torch.tensor([ids + out])).logits[0]
    assert logits[len(ids) - 1 : len(ids) + len(out) - 1].argmax(-1).tolist() == out


def _kill_prefill(c: Cluster) -> int:
    """SIGKILL the prefill worker and wait until it is gone (its sockets closed)."""
    pid = c.pids()["prefill-0"]
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
        except OSError:
            return True

    assert wait_until(gone, timeout_s=10)
    return pid


def _served_again(c: Cluster, old_pid: int, body: dict) -> dict:
    """The first 200 through the edge once the supervisor restarted the prefill."""
    assert wait_until(lambda: c.pids()["prefill-0"] != old_pid, timeout_s=30)
    answers: list[dict] = []

    def ok() -> bool:
        answers.append(_answer(c.router_url, "/completions", body))
        return answers[-1]["status"] == 200

    assert wait_until(ok, timeout_s=120, interval_s=0.5), answers[-1]
    return answers[-1]


def _same_error(edge: dict, router: dict) -> None:
    assert edge["server"] is None and router["server"] == "uvicorn"
    assert edge["status"] == router["status"] and edge["status"] in (502, 503), (edge, router)
    assert edge["error"]["type"] == router["error"]["type"]
    assert edge["error"].get("code") == router["error"].get("code")
    assert "prefill" in edge["error"]["message"]


def _failover_body(reference: LLMEngine) -> tuple[dict, str]:
    prompt = f"Session 7: {_words(7, 20)}"
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    body["ignore_eos"] = True
    return body, _greedy(reference, reference.info.tokenizer.encode(prompt), 4)[1]


@pytest.mark.slow
def test_zy_first_request_after_a_prefill_kill_as_in_python(cluster, reference):
    """The first request after the prefill was killed gets the same error through the
    edge as from the Python data plane, each after its own kill; once the supervisor
    restarted the prefill, requests through the edge are exact again."""
    body, want = _failover_body(reference)
    answers = []
    for base in (cluster.router_url, cluster.python_url):
        old = _kill_prefill(cluster)
        answers.append(_answer(base, "/completions", body))
        answers.append(_answer(base, "/completions", dict(body, stream=True)))
        assert _served_again(cluster, old, body)["text"] == want
    _same_error(answers[0], answers[2])
    _same_error(answers[1], answers[3])


def test_zz_prefill_killed_while_the_edge_serves(cluster, reference):
    """Last in the module (it leaves the cluster without a prefill for a while): the
    first request through the edge after the prefill was killed is a clear 5xx naming
    it; the next ones, through the edge and through the Python data plane, the same
    error; the decode worker is left with nothing running."""
    body, _ = _failover_body(reference)
    _kill_prefill(cluster)
    first = _answer(cluster.router_url, "/completions", body)
    assert first["server"] is None and first["status"] in (502, 503), first
    assert "prefill" in first["error"]["message"]
    python = _answer(cluster.python_url, "/completions", body)
    _same_error(_answer(cluster.router_url, "/completions", body), python)
    _same_error(_answer(cluster.router_url, "/completions", dict(body, stream=True)), python)
    assert wait_until(lambda: cluster.status(cluster.decode_url)["num_running"] == 0, 2.0)

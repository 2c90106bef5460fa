"""The router's OpenAI API through the official `openai` client, against stand-in workers
(tests/router_standin.py) and the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from router_standin import RouterHarness

TEXT = "Hello world! The answer is 42."


@pytest.fixture(scope="module")
def harness() -> Iterator[RouterHarness]:
    h = RouterHarness()
    yield h
    h.close()


@pytest.fixture
def h(harness: RouterHarness) -> RouterHarness:
    harness.reset()
    eos = harness.info.eos_token_ids[0]
    harness.set_output([*harness.info.tokenizer.encode(TEXT), eos], usage_split=(8, 16))
    return harness


def _messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": "What is the answer?"}]


def test_chat_non_streaming(h: RouterHarness) -> None:
    r = h.openai().chat.completions.create(model=h.served_name, messages=_messages())
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == h.served_name
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content == TEXT
    # The prompt is the chat template's rendering, tokenized once by the router.
    template = h.info.chat_template.render(_messages(), add_generation_prompt=True)
    prompt_ids = h.info.tokenizer.encode(template, add_special_tokens=False)
    assert h.prefill[0].received[0][1].prompt_token_ids == prompt_ids
    u = r.usage
    assert u is not None and u.prompt_tokens == len(prompt_ids)
    assert u.completion_tokens == len(h.info.tokenizer.encode(TEXT)) + 1  # + EOS
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    details = u.prompt_tokens_details.model_dump()
    assert details["cached_tokens"] == 8 + 16 and details["gpu_tokens"] == 8
    assert details["pool_tokens"] == 16
    assert details["computed_tokens"] == len(prompt_ids) - 24


def test_chat_streaming_with_usage(h: RouterHarness) -> None:
    chunks = list(
        h.openai().chat.completions.create(
            model=h.served_name,
            messages=_messages(),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_usage_has_no_usage_chunk(h: RouterHarness) -> None:
    chunks = list(
        h.openai().chat.completions.create(model=h.served_name, messages=_messages(), stream=True)
    )
    assert all(c.choices for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_text_and_token_prompts(h: RouterHarness) -> None:
    client = h.openai()
    r = client.completions.create(model=h.served_name, prompt="The answer is", max_tokens=50)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == TEXT and r.choices[0].finish_reason == "stop"
    sent = h.prefill[0].received[-1][1]
    assert sent.prompt_token_ids == h.info.tokenizer.encode("The answer is")
    for prompt in ([5, 6, 7], [[5, 6, 7]], ["The answer is"]):
        r = client.completions.create(model=h.served_name, prompt=prompt, max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None and r.usage.completion_tokens == 3
    assert h.prefill[0].received[-2][1].prompt_token_ids == [5, 6, 7]


def test_completion_streaming_and_logprobs(h: RouterHarness) -> None:
    chunks = list(
        h.openai().completions.create(
            model=h.served_name,
            prompt="x",
            stream=True,
            logprobs=1,
            max_tokens=4,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Hello world! The"
    lps = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert lps == [-0.5, -0.25, -0.25, -0.25]
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_logprobs(h: RouterHarness) -> None:
    r = h.openai().chat.completions.create(
        model=h.served_name, messages=_messages(), logprobs=True, top_logprobs=0, max_tokens=2
    )
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hello", " world"]
    assert [c.logprob for c in content] == [-0.5, -0.25]
    assert h.prefill[0].received[-1][1].params.logprobs is True


def test_stop_strings_cut_text_and_abort_decode(h: RouterHarness) -> None:
    """The stand-ins ignore stop strings: the router cuts the text and aborts decode."""
    client = h.openai()
    r = client.chat.completions.create(model=h.served_name, messages=_messages(), stop="answer")
    assert r.choices[0].message.content == "Hello world! The "
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model=h.served_name, prompt="q", stop=["42", "!"], stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"
    params = h.prefill[0].received[-1][1].params
    assert params.stop == ("42", "!")


def test_sampling_params_reach_workers(h: RouterHarness) -> None:
    h.openai().chat.completions.create(
        model=h.served_name,
        messages=_messages(),
        max_completion_tokens=7,
        temperature=0.3,
        top_p=0.9,
        seed=11,
        user="session-1",
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"17": -5, "3": 2.5},
        logprobs=True,
        top_logprobs=4,
        response_format={"type": "json_object"},
        extra_body={"top_k": 5, "min_tokens": 2, "ignore_eos": True, "repetition_penalty": 1.1},
    )
    # two worker calls at once: decode (it answers DecodeReady) and prefill, which gets
    # decode's landing in a LandingGrant
    kind, decode_req = h.decode[0].received[0]
    assert kind == "decode" and decode_req.params.max_tokens == 7
    assert len(h.decode[0].received) == 1 and len(h.prefill[0].received) == 1
    prefill_req = h.prefill[0].received[0][1]
    p = prefill_req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k) == (7, 0.3, 0.9, 11, 5)
    assert p.min_tokens == 2 and p.ignore_eos is True
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.1)
    assert p.logit_bias == ((17, -5.0), (3, 2.5)) and (p.logprobs, p.top_logprobs) == (True, 4)
    assert p.grammar is not None and p.grammar.kind == "json_object"
    assert decode_req.params == p
    assert decode_req.prompt_token_ids == prefill_req.prompt_token_ids
    assert prefill_req.await_landing and not prefill_req.landing
    (grant,) = h.prefill[0].landings
    assert grant.request_id == prefill_req.request_id and grant.landing
    assert grant.notify_url.endswith("/kv_notify")


def test_default_max_tokens_is_remaining_context(h: RouterHarness) -> None:
    h.openai().completions.create(model=h.served_name, prompt=[1, 2, 3])
    assert h.prefill[0].received[0][1].params.max_tokens == h.info.max_context_len - 3


def test_first_token_finish_skips_decode(h: RouterHarness) -> None:
    r = h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=1)
    assert r.choices[0].text == "Hello" and r.choices[0].finish_reason == "length"
    assert h.decode[0].received == []  # max_tokens == 1: decode is never called
    assert h.prefill[0].received[0][1].landing == []
    h.set_output([h.info.eos_token_ids[0], 100])
    r = h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=5)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    kinds = [k for k, _ in h.decode[0].received]
    assert kinds == ["decode"]  # its stream opened, then freed by an abort
    rid = h.decode[0].received[0][1].request_id
    _wait_for(lambda: rid in h.decode[0].aborted_ids())
    assert [a.reason for _, a in h.decode[0].aborts if a.request_id == rid] == ["finished"]


def test_models_health_metrics(h: RouterHarness) -> None:
    models = h.openai().models.list()
    assert [m.id for m in models.data] == [h.served_name]
    health = httpx.get(h.url + "/health", trust_env=False).json()
    assert health["status"] == "ok" and health["prefill"]["healthy"] == 1
    h.openai().completions.create(model=h.served_name, prompt="x", max_tokens=3)
    text = httpx.get(h.url + "/metrics", trust_env=False).text
    for name in (
        'kvserve_router_requests_total{endpoint="completion",status="200"}',
        "kvserve_router_time_to_first_token_seconds_bucket",
        "kvserve_router_inter_token_latency_seconds_bucket",
        "kvserve_router_e2e_request_latency_seconds_bucket",
        'kvserve_router_prompt_tokens_total{source="pool"}',
        "kvserve_router_requests_in_flight 0.0",
        'kvserve_router_instance_healthy{instance="p0",role="prefill"} 1.0',
    ):
        assert name in text, name


def test_reset_prefix_cache_fans_out(h: RouterHarness) -> None:
    r = httpx.post(h.url + "/v1/admin/reset_prefix_cache", trust_env=False)
    assert r.status_code == 200 and r.json()["success"] is True
    assert h.prefill[0].resets == 1 and h.decode[0].resets == 0


def test_model_spec_is_accepted_as_model_name(h: RouterHarness) -> None:
    r = h.openai().completions.create(
        model="builtin:smollm2-135m-instruct", prompt="x", max_tokens=2
    )
    assert r.choices[0].text == "Hello world"


def _wait_for(cond: object, timeout_s: float = 2.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_api_key() -> None:
    h = RouterHarness(api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            h.openai(api_key="wrong").completions.create(model=h.served_name, prompt="x")
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        r = httpx.post(h.url + "/v1/completions", json={"prompt": "x"}, trust_env=False)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        ok = h.openai(api_key="sekret").completions.create(
            model=h.served_name, prompt="x", max_tokens=2
        )
        assert ok.choices[0].text
        assert httpx.get(h.url + "/health", trust_env=False).status_code == 200
    finally:
        h.close()


def test_worker_finish_first_flushes_held_back_text(h: RouterHarness) -> None:
    """The stand-in ends at its canned output ("length") before the router's max_tokens:
    the worker's reason stands and the text the router held back for a possible stop
    string ("42." could start "42.!") is released."""
    h.set_output(h.info.tokenizer.encode(TEXT))
    r = h.openai().completions.create(
        model=h.served_name, prompt="x", max_tokens=500, stop=["42.!"]
    )
    assert r.choices[0].text == TEXT and r.choices[0].finish_reason == "length"


def test_client_connections_have_tcp_nodelay(h: RouterHarness) -> None:
    import socket

    with httpx.Client(trust_env=False) as client:  # keep-alive: the connection stays open
        assert client.get(h.url + "/health").status_code == 200
        connections = list(h.router.server.server_state.connections)
        assert connections
        for conn in connections:
            sock = conn.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

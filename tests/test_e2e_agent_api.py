"""End to end, the agent-facing API on SmolLM2 through `kvserve up` (real prefill and
decode processes, the handoff, the router) with the official openai client: a forced
tool round trip, streamed tool calls equal to the whole response, json_schema output,
n choices, and top_logprobs against the single-process engine."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from cluster_harness import Cluster, start_cluster

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(900)

MODEL = "builtin:smollm2-135m-instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("agent"),
        MODEL,
        cache_dir=weights_cache_dir,
        # SmolLM2's KV is 45 KiB a token: room for 10 choices of ~150 tokens at once.
        prefill={"kv_cache_memory": "256MiB"},
        decode={"kv_cache_memory": "256MiB", "landing_memory": "64MiB"},
        router={"request_timeout_s": 300},
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_base, api_key="unused", max_retries=0, timeout=300)


def _call(client: openai.OpenAI, cluster: Cluster, **kw: Any) -> Any:
    return client.chat.completions.create(model=cluster.served_name, **kw)


def test_forced_tool_round_trip(client, cluster) -> None:
    first = _call(
        client,
        cluster,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=FORCED,
        temperature=0,
        max_tokens=80,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)

    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = _call(client, cluster, messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert not answer.message.tool_calls
    assert answer.message.content and answer.message.content.strip()
    # The tool's result reached the prompt: the second prompt is the first one, the call
    # and the result (more tokens than the call alone).
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(client, cluster) -> None:
    kw = {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
    }
    whole = _call(client, cluster, **kw).choices[0]
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish = None
    num_argument_chunks = 0
    for chunk in _call(client, cluster, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                if d.id:
                    assert not entry["id"], "a call's id comes once"
                    entry["id"] = d.id
                if d.function and d.function.name:
                    entry["name"] += d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
                    num_argument_chunks += 1
    assert finish == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert got == want
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert num_argument_chunks > 1  # the arguments streamed in fragments


@pytest.mark.slow  # CI time: docs/testing.md
def test_json_schema_output_is_valid_in_10_seeded_samples(client, cluster) -> None:
    """Ten choices sampled at temperature 1 under the schema's grammar, all valid and not
    all the same (tests/test_logits_processing.py samples the grammar on random logits)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {
                "type": "array",
                "items": {"type": "string", "maxLength": 15},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    r = _call(  # choice i samples with seed + i
        client,
        cluster,
        messages=messages,
        response_format=fmt,
        temperature=1.0,
        seed=10000,
        n=10,
        max_tokens=120,
    )
    assert len(r.choices) == 10 and sorted(c.index for c in r.choices) == list(range(10))
    texts = []
    for c in r.choices:
        assert c.finish_reason == "stop", c
        texts.append(c.message.content)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # temperature 1 really sampled


@pytest.fixture(scope="module")
def reference(weights_cache_dir: str):
    ref = LLMEngine.from_spec(MODEL, EngineConfig(dtype="float32", cache_dir=weights_cache_dir))
    yield ref
    ref.close()


def _prompt_ids(ref: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    text = ref.info.chat_template.render(messages, add_generation_prompt=True)
    return ref.info.tokenizer.encode(text, add_special_tokens=False)


def test_n_greedy_choices_are_identical(client, cluster, reference) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    r = _call(client, cluster, messages=messages, temperature=0, n=3, max_tokens=24)
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = reference.generate(
        [_prompt_ids(reference, messages)], SamplingParams(max_tokens=24, temperature=0.0)
    )[0]
    assert [c.message.content for c in r.choices] == [want.text] * 3
    assert r.usage.completion_tokens == 3 * len(want.token_ids)
    assert r.usage.prompt_tokens == len(_prompt_ids(reference, messages))  # counted once
    texts = ["", "", ""]
    finishes: list[str | None] = [None, None, None]
    stream = _call(
        client,
        cluster,
        messages=messages,
        temperature=0,
        n=3,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [want.text] * 3 and None not in finishes
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens


def test_top_logprobs_equal_the_engine_log_softmax(client, cluster, reference) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    r = _call(
        client,
        cluster,
        messages=messages,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs.content
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5)
    outs = list(reference.stream(_prompt_ids(reference, messages), params))
    tops = [t for o in outs for t in (o.new_top_logprobs or [])]
    assert len(tops) == len(content) == 6  # the first from prefill, the rest from decode
    tokenizer = reference.info.tokenizer
    for got, want in zip(content, tops, strict=True):
        assert want is not None
        alt = [(a.token, a.logprob) for a in got.top_logprobs]
        assert [t for t, _ in alt] == [
            tokenizer.decode([i], skip_special_tokens=False) for i, _ in want
        ]
        for (_, lp), (_, ref_lp) in zip(alt, want, strict=True):
            assert math.isclose(lp, ref_lp, abs_tol=1e-4)
        assert got.logprob == pytest.approx(alt[0][1])  # greedy: the top alternative


def test_penalties_and_logit_bias_match_the_engine_and_change_the_output(
    client, cluster, reference
) -> None:
    """Through prefill (first token) and decode (the rest): the served text equals the
    single-process engine's under the same penalties, and differs from the plain one. The
    three cases are served at once (per-request penalties in one batch), and the reference
    runs them in one batch too."""
    messages = [{"role": "user", "content": "Write the word cat five times."}]
    ids = _prompt_ids(reference, messages)
    plain = _call(client, cluster, messages=messages, temperature=0, max_tokens=16)
    plain_text = plain.choices[0].message.content
    first_id = reference.info.tokenizer.encode(plain_text, add_special_tokens=False)[0]
    cases = [
        {"repetition_penalty": 1.6},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"logit_bias": {str(first_id): -100.0}},
    ]

    def served(case: dict[str, Any]) -> str:
        body = dict(case)
        bias = body.pop("logit_bias", None)
        extra = (
            {"repetition_penalty": body.pop("repetition_penalty")}
            if "repetition_penalty" in body
            else {}
        )
        r = _call(
            client,
            cluster,
            messages=messages,
            temperature=0,
            max_tokens=16,
            logit_bias=bias,
            extra_body=extra or None,
            **body,
        )
        text: str = r.choices[0].message.content
        return text

    with ThreadPoolExecutor(len(cases)) as pool:
        served_texts = list(pool.map(served, cases))
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0.0,
            repetition_penalty=case.get("repetition_penalty", 1.0),
            frequency_penalty=case.get("frequency_penalty", 0.0),
            presence_penalty=case.get("presence_penalty", 0.0),
            logit_bias=tuple((int(k), v) for k, v in case.get("logit_bias", {}).items()),
        )
        for case in cases
    ]
    wants = [o.text for o in reference.generate([ids] * len(cases), params)]
    for case, got, want in zip(cases, served_texts, wants, strict=True):
        assert got == want, case
        assert got != plain_text, case

"""End to end: internal authentication and landing capabilities on a real cluster
(`kvserve up`: real prefill and decode processes, Mooncake tcp handoff, the router).

- every internal route of both workers answers 401 without the cluster secret (or with
  a wrong one); /health and /metrics stay open; the router, `kvserve status` and the
  workers' own calls carry it, so serving works unchanged;
- an insider holding the secret but sending prefill a landing decode did not mint for
  that request (altered address, another request's capability, none) gets a 403 and
  prefill writes not one byte (its handoff counters do not move); the genuine landing
  of the same decode reservation then serves the request exactly;
- decode refuses (400) a landed-piece notice naming bytes outside the region it
  reserved for the request."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
from cluster_harness import Cluster, kvserve, metric_sum, start_cluster, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    FirstToken,
    KVSegment,
    PrefillRequest,
    SegmentsLanded,
    TokenBatch,
)
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e-auth"), str(tiny_llama_dir), cache_dir=weights_cache_dir
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))


def _prefill_idle(cluster: Cluster) -> bool:
    st = cluster.status(cluster.prefill_url)
    return bool(st["num_running"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"])


INTERNAL = [
    ("prefill", "POST", "/prefill"),
    ("prefill", "POST", "/admin/reset_prefix_cache"),
    ("prefill", "POST", "/abort"),
    ("prefill", "GET", "/status"),
    ("prefill", "GET", "/info"),
    ("prefill", "GET", "/kv_events/stream"),
    ("decode", "POST", "/decode"),
    ("decode", "POST", "/kv_notify"),
    ("decode", "POST", "/abort"),
    ("decode", "GET", "/status"),
    ("decode", "GET", "/info"),
]


def test_internal_routes_need_the_cluster_secret(cluster: Cluster):
    urls = {"prefill": cluster.prefill_url, "decode": cluster.decode_url}
    wrong = {"authorization": "Bearer " + "x" * 43}
    body = msgspec.json.encode(AbortRequest("nobody"))
    for role, method, path in INTERNAL:
        for headers in ({}, wrong):
            r = httpx.request(method, urls[role] + path, content=body, headers=headers, timeout=10)
            assert r.status_code == 401, (role, path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    for url in urls.values():
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        st = httpx.get(url + "/status", headers=cluster.headers, timeout=10)
        assert st.status_code == 200
    res = kvserve("status", "-c", str(cluster.config), "--state-dir", str(cluster.state_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [
        line.split()
        for line in res.stdout.splitlines()
        if line.startswith(("prefill-0", "decode-0"))
    ]
    assert len(rows) == 2 and all(row[-1] == "up" for row in rows), res.stdout
    assert all("/" in row[-2] for row in rows)  # KV FREE/TOTAL read from /status


def test_serving_through_the_router_is_unchanged(cluster: Cluster, reference: LLMEngine):
    want = reference.generate([PROMPT], PARAMS)[0].token_ids
    r = httpx.post(
        cluster.api_base + "/completions",
        json={
            "model": cluster.served_name,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.info.tokenizer.decode(want)


def test_a_forged_landing_writes_nothing_and_the_genuine_one_serves(
    cluster: Cluster, reference: LLMEngine
):
    want = reference.generate([PROMPT], PARAMS)[0].token_ids
    client = httpx.Client(headers=cluster.headers, timeout=60)
    prefill = cluster.prefill_url
    dreq = DecodeRequest(PROTOCOL_VERSION, "victim", PROMPT, PARAMS)
    with client.stream(
        "POST", cluster.decode_url + "/decode", content=msgspec.json.encode(dreq)
    ) as dr:
        assert dr.status_code == 200
        lines = (line for line in dr.iter_lines() if line)
        ready = msgspec.json.decode(next(lines), type=DecodeReady)
        (landing,) = ready.landing
        assert landing.capability and landing.expires_at_s > 0
        # An earlier request's flow may still be closing (it is counted when prefill's
        # engine takes the report, after the client had its answer): prefill releases a
        # request's blocks in that same update, so all blocks free = every flow counted.
        assert wait_until(lambda: _prefill_idle(cluster), timeout_s=60)
        bytes_before = metric_sum(prefill, "kvserve_handoff_bytes_total")
        ops_before = metric_sum(prefill, "kvserve_handoff_ops_total")
        forged = {
            "shifted": msgspec.structs.replace(landing, buffer_addr=landing.buffer_addr + 4096),
            "widened": msgspec.structs.replace(landing, capacity_bytes=landing.capacity_bytes * 4),
            "unsigned": msgspec.structs.replace(landing, capability=""),
        }
        for what, bad in forged.items():
            req = PrefillRequest(
                PROTOCOL_VERSION, "victim", PROMPT, PARAMS, [bad], ready.notify_url
            )
            r = client.post(prefill + "/prefill", content=msgspec.json.encode(req))
            assert r.status_code == 403, (what, r.text)
            assert "landing refused" in r.json()["message"]
        # the genuine landing under another request id: a replay, refused as well
        replay = PrefillRequest(
            PROTOCOL_VERSION, "thief", PROMPT, PARAMS, [landing], ready.notify_url
        )
        r = client.post(prefill + "/prefill", content=msgspec.json.encode(replay))
        assert r.status_code == 403 and "forged or altered" in r.json()["message"]
        assert metric_sum(prefill, "kvserve_handoff_bytes_total") == bytes_before
        assert metric_sum(prefill, "kvserve_handoff_ops_total") == ops_before
        # decode refuses a piece naming bytes outside the region it reserved
        nbytes = 16 * landing.layout.bytes_per_token
        outside = KVSegment(0, 16, landing.capacity_bytes - nbytes // 2, nbytes)
        notice = SegmentsLanded("victim", 0, 1, [outside])
        r = client.post(ready.notify_url, content=msgspec.json.encode(notice))
        assert r.status_code == 400 and "outside" in r.json()["message"], r.text
        # the reservation is intact: the genuine landing serves the request exactly
        req = PrefillRequest(
            PROTOCOL_VERSION, "victim", PROMPT, PARAMS, [landing], ready.notify_url
        )
        r = client.post(prefill + "/prefill", content=msgspec.json.encode(req))
        assert r.status_code == 200, r.text
        first = msgspec.json.decode(r.content.splitlines()[0], type=FirstToken)
        batches = [msgspec.json.decode(line, type=TokenBatch) for line in lines]
    assert [first.token_id] + [t for b in batches for t in b.token_ids] == want
    assert metric_sum(prefill, "kvserve_handoff_bytes_total") > bytes_before
    client.close()

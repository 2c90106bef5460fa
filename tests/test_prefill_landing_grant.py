"""End to end: a prefill request sent beside decode's (PrefillRequest.await_landing,
protocol 5) on a real cluster (`kvserve up`: a prefill of two pipeline stages, a decode
instance, Mooncake tcp handoff), driven over the workers' own HTTP endpoints with the
cluster secret, as the router does:

- prefill computes before decode's landing exists and keeps the KV; the grant (POST
  /landing) makes both stages write it, and decode's greedy tokens equal a single-process
  engine's;
- a grant that comes before its request is kept and used;
- a grant with an altered capability is refused (403) and writes nothing; a second
  grant conflicts (409); one for an aborted or finished request is gone (410);
- no grant within `landing_wait_s`: prefill frees the KV, a late grant gets 410.

tests/test_handoff_grant.py checks the scheduler side's bookkeeping alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from cluster_harness import Cluster, metric_sum, start_cluster, wait_until

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeReady,
    DecodeRequest,
    FirstToken,
    LandingGrant,
    PrefillRequest,
    TokenBatch,
)
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WAIT_S = 1.5
"""prefill[].landing_wait_s of the cluster: short, so the expiry test waits little."""


def _prompt(seed: int) -> list[int]:
    return [(7 * i + seed) % 200 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: Path, weights_cache_dir: str) -> Iterator[Cluster]:
    c = start_cluster(
        tmp_path_factory.mktemp("landing-grant"),
        str(tiny_llama_dir),
        cache_dir=weights_cache_dir,
        name="grant",
        prefill={
            "devices": ["cpu", "cpu"],
            "pipeline_parallel": 2,
            "landing_wait_s": WAIT_S,
        },
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, weights_cache_dir: str) -> LLMEngine:
    return LLMEngine.from_spec(str(tiny_llama_dir), EngineConfig(cache_dir=weights_cache_dir))


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(headers=cluster.headers, timeout=60) as c:
        yield c


def _prefill(client: httpx.Client, cluster: Cluster, rid: str, prompt: list[int]) -> FirstToken:
    req = PrefillRequest(PROTOCOL_VERSION, rid, prompt, PARAMS, [], await_landing=True)
    r = client.post(cluster.prefill_url + "/prefill", content=msgspec.json.encode(req))
    assert r.status_code == 200, r.text
    (line,) = r.content.splitlines()  # the stream ends at the first token
    return msgspec.json.decode(line, type=FirstToken)


def _grant(client: httpx.Client, cluster: Cluster, ready: DecodeReady) -> httpx.Response:
    grant = LandingGrant(PROTOCOL_VERSION, ready.request_id, ready.landing, ready.notify_url)
    return client.post(cluster.prefill_url + "/landing", content=msgspec.json.encode(grant))


def _kv_free(cluster: Cluster) -> bool:
    st = cluster.status(cluster.prefill_url)
    return bool(st["num_running"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"])


def _grants(cluster: Cluster, outcome: str) -> float:
    return metric_sum(cluster.prefill_url, "kvserve_prefill_landing_grants_total", outcome=outcome)


def _stage_bytes(cluster: Cluster) -> list[float]:
    return [
        metric_sum(cluster.prefill_url, "kvserve_handoff_bytes_total", stage=str(s))
        for s in range(2)
    ]


def _decode(client: httpx.Client, cluster: Cluster, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    req = DecodeRequest(PROTOCOL_VERSION, rid, prompt, PARAMS)
    return client.stream("POST", cluster.decode_url + "/decode", content=msgspec.json.encode(req))


def _tokens(lines: Iterator[str]) -> list[int]:
    return [t for line in lines for t in msgspec.json.decode(line, type=TokenBatch).token_ids]


def test_prefill_computes_before_the_landing_and_both_stages_write_it(
    cluster: Cluster, client: httpx.Client, reference: LLMEngine
) -> None:
    prompt = _prompt(3)
    want = reference.generate([prompt], PARAMS)[0].token_ids
    before, accepted = _stage_bytes(cluster), _grants(cluster, "accepted")
    first = _prefill(client, cluster, "concurrent", prompt)  # computed, KV kept, no landing
    assert first.token_id == want[0] and first.usage.computed_tokens == len(prompt)
    assert _stage_bytes(cluster) == before  # nothing written without a landing
    with _decode(client, cluster, "concurrent", prompt) as dr:
        assert dr.status_code == 200
        lines = (line for line in dr.iter_lines() if line)
        ready = msgspec.json.decode(next(lines), type=DecodeReady)
        r = _grant(client, cluster, ready)
        assert r.status_code == 200 and r.json()["outcome"] == "accepted", r.text
        assert [first.token_id, *_tokens(lines)] == want
    assert _grants(cluster, "accepted") == accepted + 1
    after = _stage_bytes(cluster)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert wait_until(lambda: _kv_free(cluster), timeout_s=30)  # flows closed: blocks free
    assert _grant(client, cluster, ready).status_code == 410  # ended: a late grant is gone


def test_a_grant_before_its_request_is_kept_and_used(
    cluster: Cluster, client: httpx.Client, reference: LLMEngine
) -> None:
    prompt = _prompt(11)
    want = reference.generate([prompt], PARAMS)[0].token_ids
    with _decode(client, cluster, "early", prompt) as dr:
        lines = (line for line in dr.iter_lines() if line)
        ready = msgspec.json.decode(next(lines), type=DecodeReady)
        r = _grant(client, cluster, ready)
        assert r.status_code == 200 and r.json()["outcome"] == "early", r.text
        first = _prefill(client, cluster, "early", prompt)
        assert [first.token_id, *_tokens(lines)] == want
        assert _grant(client, cluster, ready).status_code in (409, 410)  # has its landing


def test_refused_conflicting_and_gone_grants(
    cluster: Cluster, client: httpx.Client, reference: LLMEngine
) -> None:
    prompt = _prompt(19)
    want = reference.generate([prompt], PARAMS)[0].token_ids
    with _decode(client, cluster, "checked", prompt) as dr:
        lines = (line for line in dr.iter_lines() if line)
        ready = msgspec.json.decode(next(lines), type=DecodeReady)
        first = _prefill(client, cluster, "checked", prompt)
        before, refused = _stage_bytes(cluster), _grants(cluster, "refused")
        (landing,) = ready.landing
        shifted = msgspec.structs.replace(landing, buffer_addr=landing.buffer_addr + 4096)
        forged = msgspec.structs.replace(ready, landing=[shifted])
        r = _grant(client, cluster, forged)
        assert r.status_code == 403 and "landing refused" in r.json()["message"], r.text
        assert _grants(cluster, "refused") == refused + 1 and _stage_bytes(cluster) == before
        assert _grant(client, cluster, ready).status_code == 200  # the genuine one serves
        r = _grant(client, cluster, ready)
        assert r.status_code == 409 and "landing already" in r.json()["message"], r.text
        assert [first.token_id, *_tokens(lines)] == want
    # a request the router aborted: its grant is gone, and its KV was freed
    _prefill(client, cluster, "aborted", prompt)
    abort = AbortRequest("aborted", prefill_contacted=False)
    assert client.post(cluster.prefill_url + "/abort", content=msgspec.json.encode(abort))
    assert wait_until(lambda: _kv_free(cluster), timeout_s=30)
    gone = msgspec.structs.replace(ready, request_id="aborted")
    r = _grant(client, cluster, gone)
    assert r.status_code == 410 and "aborted" in r.json()["message"], r.text
    # malformed: no landing
    empty = LandingGrant(PROTOCOL_VERSION, "x", [], "")
    r = client.post(cluster.prefill_url + "/landing", content=msgspec.json.encode(empty))
    assert r.status_code == 400
    bad = PrefillRequest(
        PROTOCOL_VERSION, "both", prompt, PARAMS, ready.landing, ready.notify_url, True
    )
    r = client.post(cluster.prefill_url + "/prefill", content=msgspec.json.encode(bad))
    assert r.status_code == 400 and "await_landing" in r.json()["message"]


def test_no_grant_in_time_frees_the_kv_and_a_late_grant_is_gone(
    cluster: Cluster, client: httpx.Client
) -> None:
    prompt = _prompt(29)
    expired = metric_sum(
        cluster.prefill_url, "kvserve_prefill_requests_total", outcome="landing_expired"
    )
    with _decode(client, cluster, "late", prompt) as dr:
        lines = (line for line in dr.iter_lines() if line)
        ready = msgspec.json.decode(next(lines), type=DecodeReady)
        _prefill(client, cluster, "late", prompt)
        st = cluster.status(cluster.prefill_url)
        assert st["kv_blocks_free"] < st["kv_blocks_total"]  # kept for the grant
        assert wait_until(lambda: _kv_free(cluster), timeout_s=WAIT_S + 20)
        n = metric_sum(
            cluster.prefill_url, "kvserve_prefill_requests_total", outcome="landing_expired"
        )
        assert n == expired + 1
        r = _grant(client, cluster, ready)
        assert r.status_code == 410 and "landing_wait_s" in r.json()["message"], r.text
        abort = AbortRequest("late", prefill_contacted=False)
        client.post(cluster.decode_url + "/abort", content=msgspec.json.encode(abort))

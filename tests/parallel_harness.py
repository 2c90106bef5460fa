"""A cluster of parallel prefill and decode instances (`kvserve up` on 127.0.0.1), and a
client that drives one (prefill, decode) pair the way the router does: /decode (its
DecodeReady), then /prefill with that landing, then decode's tokens, so a test chooses
the pair; the flows are checked from the workers' handoff metrics."""

from __future__ import annotations

import concurrent.futures as cf
import math
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
from cluster_harness import free_ports, internal_headers, kvserve, launch, router_section

from protocol.messages import (
    PROTOCOL_VERSION,
    DecodeReady,
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    TokenBatch,
)
from protocol.parallel import stripe_len
from protocol.sampling import SamplingParams

MAX_OP_BYTES = 8 << 20


@dataclass
class ParallelCluster:
    config: Path
    state_dir: Path
    router_url: str
    urls: dict[str, str]
    """Base URL of every instance by name."""
    layouts: dict[str, tuple[int, ...]]
    """(pp,) of a prefill, (tp, dcp) of a decode."""
    served_name: str = "parallel-model"

    @property
    def headers(self) -> dict[str, str]:
        """What internal calls to the workers carry (the cluster secret)."""
        return internal_headers(self.state_dir, "parallel")

    def down(self) -> None:
        res = kvserve("down", "-c", str(self.config), "--state-dir", str(self.state_dir))
        assert res.returncode == 0, res.stderr


def start_parallel_cluster(
    tmp: Path,
    model: str,
    *,
    cache_dir: str,
    prefill: dict[str, dict],
    decode: dict[str, dict],
    dtype: str = "float32",
    max_batched_tokens: int = 32,
    extra: dict | None = None,
) -> ParallelCluster:
    """prefill: name -> {pipeline_parallel, layer_split?}; decode: name -> {tensor_parallel,
    decode_context_parallel}. Every instance runs on cpu devices with small memories.
    `extra`: top-level cluster.yaml keys to add or replace."""
    ports = free_ports(1 + len(prefill) + len(decode))
    urls, layouts = {}, {}
    prefills, decodes = [], []
    for (name, p), port in zip(prefill.items(), ports[1:], strict=False):
        pp = p["pipeline_parallel"]
        prefills.append(
            {
                "name": name,
                "node": "local",
                "port": port,
                "devices": ["cpu"] * pp,
                "max_batched_tokens": max_batched_tokens,
                "max_num_seqs": 16,
                "kv_cache_memory": "16MiB",
                **p,
            }
        )
        urls[name], layouts[name] = f"http://127.0.0.1:{port}", (pp,)
    for (name, d), port in zip(decode.items(), ports[1 + len(prefill) :], strict=True):
        tp = d["tensor_parallel"]
        decodes.append(
            {
                "name": name,
                "node": "local",
                "port": port,
                "devices": ["cpu"] * tp,
                "max_num_seqs": 16,
                "kv_cache_memory": "16MiB",
                "landing_memory": "8MiB",
                **d,
            }
        )
        urls[name] = f"http://127.0.0.1:{port}"
        layouts[name] = (tp, d.get("decode_context_parallel", 1))
    cfg = {
        "name": "parallel",
        "model": model,
        "dtype": dtype,
        "cache": {"block_size": 16, "chunk_size": 256, "weights_cache_dir": cache_dir},
        "nodes": [{"name": "local", "host": "127.0.0.1"}],
        "prefill": prefills,
        "decode": decodes,
        "router": router_section(ports[0], "parallel-model", timeout_s=120),
        **(extra or {}),
    }
    config, state = launch(tmp, cfg, timeout=600)
    return ParallelCluster(config, state, f"http://127.0.0.1:{ports[0]}", urls, layouts)


@dataclass
class PairResult:
    tokens: list[int]
    ready: DecodeReady
    num_prompt_tokens: int


def _ndjson_lines(r: httpx.Response, url: str):  # type: ignore[no-untyped-def]
    if r.status_code != 200:
        r.read()
        raise AssertionError(f"{url}: {r.status_code} {r.text}")
    return (line for line in r.iter_lines() if line)


def run_pair(
    prefill_url: str,
    decode_url: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    headers: dict[str, str],
) -> PairResult:
    """One request through a chosen prefill and decode instance (what router/relay.py
    does, without its choices): decode's stream first, prefill told where to send.
    `headers`: the cluster secret's (ParallelCluster.headers)."""
    with httpx.Client(headers=headers) as client:
        dreq = DecodeRequest(PROTOCOL_VERSION, request_id, prompt, params)
        with client.stream(
            "POST", decode_url + "/decode", content=msgspec.json.encode(dreq), timeout=120
        ) as dr:
            lines = _ndjson_lines(dr, decode_url)
            ready = msgspec.json.decode(next(lines), type=DecodeReady)
            req = PrefillRequest(
                PROTOCOL_VERSION, request_id, prompt, params, ready.landing, ready.notify_url
            )
            r = client.post(prefill_url + "/prefill", content=msgspec.json.encode(req), timeout=120)
            assert r.status_code == 200, r.text
            events = [msgspec.json.decode(x, type=FirstToken) for x in r.content.splitlines() if x]
            assert len(events) == 1, events
            batches = [msgspec.json.decode(x, type=TokenBatch) for x in lines]
    tokens = [events[0].token_id] + [t for b in batches for t in b.token_ids]
    return PairResult(tokens, ready, len(prompt))


def run_pair_batch(
    prefill_url: str,
    decode_url: str,
    prompts: list[list[int]],
    params: SamplingParams,
    tag: str,
    headers: dict[str, str],
) -> list[PairResult]:
    """All prompts at once (continuous batching on both sides)."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(run_pair, prefill_url, decode_url, f"{tag}-{i}", p, params, headers)
            for i, p in enumerate(prompts)
        ]
        return [f.result() for f in futures]


def _series(url: str, name: str) -> dict[str, float]:
    """label text -> value of every sample of `name` on a worker's /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def flow_metrics(prefill_url: str, decode_url: str) -> dict[str, dict[str, float]]:
    """The handoff series a check compares before and after a batch."""
    return {
        "bytes": _series(prefill_url, "kvserve_handoff_bytes_total"),
        "ops": _series(prefill_url, "kvserve_handoff_ops_total"),
        "flows": _series(decode_url, "kvserve_handoff_flows_total"),
    }


def check_flows(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    results: list[PairResult],
    layer_split: tuple[int, ...],
) -> None:
    """Every stage of the prefill sent its layers x every rank's tokens x the rank's heads,
    ops of at most 8 MiB; decode saw every stage's flow close without error."""

    def delta(kind: str, match: str) -> float:
        return sum(v - before[kind].get(k, 0.0) for k, v in after[kind].items() if match in k)

    assert delta("flows", 'result="ok"') == len(layer_split) * len(results)
    assert delta("flows", 'result="failed"') == 0
    l0 = 0
    for stage, nl in enumerate(layer_split):
        want = 0
        for r in results:
            for info in r.ready.landing:
                n_rank = stripe_len(0, r.num_prompt_tokens, info.dcp_size, info.dcp_rank)
                want += n_rank * nl * info.layout.bytes_per_token_per_layer
        assert delta("bytes", f'stage="{stage}"') == want, (stage, l0, nl)
        writes = len(results) * len(results[0].ready.landing)  # at least a write per rank
        assert delta("ops", f'stage="{stage}"') >= max(writes, math.ceil(want / MAX_OP_BYTES))
        l0 += nl

"""A cluster of parallel prefill and decode instances (`kvserve up` on 127.0.0.1), and a
client that drives one (prefill, decode) pair the way the router does: /admit, /prefill,
/decode with protocol messages, so a test chooses the pair and sees the handoff."""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import yaml
from cluster_harness import free_ports, kvserve

from protocol.messages import (
    PROTOCOL_VERSION,
    AdmitRequest,
    AdmitResponse,
    DecodeRequest,
    FirstToken,
    HandoffDone,
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
) -> ParallelCluster:
    """prefill: name -> {pipeline_parallel, layer_split?}; decode: name -> {tensor_parallel,
    decode_context_parallel}. Every instance runs on cpu devices with small memories."""
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
        "router": {
            "host": "127.0.0.1",
            "port": ports[0],
            "policy": "round_robin",
            "served_model_name": "parallel-model",
            "request_timeout_s": 120,
        },
    }
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = tmp / "state"
    res = kvserve("up", "-c", str(config), "--detach", "--state-dir", str(state), timeout=600)
    assert res.returncode == 0, f"kvserve up failed:\n{res.stdout}\n{res.stderr}"
    return ParallelCluster(config, state, f"http://127.0.0.1:{ports[0]}", urls, layouts)


@dataclass
class PairResult:
    tokens: list[int]
    admit: AdmitResponse
    handoff: HandoffDone


def _ndjson(client: httpx.Client, url: str, body: msgspec.Struct, typ: object) -> list:
    out = []
    with client.stream("POST", url, content=msgspec.json.encode(body), timeout=120) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"{url}: {r.status_code} {r.text}")
        for line in r.iter_lines():
            if line:
                out.append(msgspec.json.decode(line, type=typ))
    return out


def run_pair(
    prefill_url: str,
    decode_url: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> PairResult:
    """One request through a chosen prefill and decode instance (what router/relay.py
    does, without its choices)."""
    with httpx.Client() as client:
        admit = AdmitRequest(PROTOCOL_VERSION, request_id, len(prompt), params.max_tokens)
        r = client.post(decode_url + "/admit", content=msgspec.json.encode(admit), timeout=60)
        assert r.status_code == 200, r.text
        landing = msgspec.json.decode(r.content, type=AdmitResponse)
        req = PrefillRequest(PROTOCOL_VERSION, request_id, prompt, params, landing.landing)
        events = _ndjson(client, prefill_url + "/prefill", req, FirstToken | HandoffDone)
        first, done = events[0], events[-1]
        assert isinstance(first, FirstToken) and isinstance(done, HandoffDone), events
        dreq = DecodeRequest(
            PROTOCOL_VERSION,
            request_id,
            prompt,
            first.token_id,
            first.logprob,
            params,
            done.segments,
        )
        batches = _ndjson(client, decode_url + "/decode", dreq, TokenBatch)
    tokens = [first.token_id] + [t for b in batches for t in b.token_ids]
    return PairResult(tokens, landing, done)


def run_pair_batch(
    prefill_url: str, decode_url: str, prompts: list[list[int]], params: SamplingParams, tag: str
) -> list[PairResult]:
    """All prompts at once (continuous batching on both sides)."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(run_pair, prefill_url, decode_url, f"{tag}-{i}", p, params)
            for i, p in enumerate(prompts)
        ]
        return [f.result() for f in futures]


def check_flows(result: PairResult, num_prompt_tokens: int, pp: int, tp: int) -> None:
    """flows = PP stages x TP ranks; each flow's bytes = its layers x the rank's tokens x
    the rank's heads; ops = sum over its segments of ceil(bytes / 8 MiB)."""
    landing = {info.rank: info for info in result.admit.landing}
    assert sorted(landing) == list(range(tp))
    flows: dict[tuple[int, int, int], list] = defaultdict(list)
    for seg in result.handoff.segments:
        layer_end = seg.layer_end if seg.layer_end is not None else 0
        flows[(seg.rank, seg.layer_start, layer_end)].append(seg)
    assert len(flows) == pp * tp, sorted(flows)
    num_ops = 0
    for (rank, l0, l1), segs in flows.items():
        info = landing[rank]
        n_rank = stripe_len(0, num_prompt_tokens, info.dcp_size, info.dcp_rank)
        want = n_rank * (l1 - l0) * info.layout.bytes_per_token_per_layer
        assert sum(s.num_bytes for s in segs) == want, (rank, l0, l1)
        num_ops += sum(math.ceil(s.num_bytes / MAX_OP_BYTES) for s in segs if s.num_bytes)
    assert result.handoff.num_ops == num_ops
    assert result.handoff.num_bytes == sum(s.num_bytes for s in result.handoff.segments)

"""Parallel layouts end to end (`kvserve up`, gloo on CPU, Mooncake tcp): prefill PP x decode
TP x DCP instances of a tiny random model; every (prefill, decode) pair must give greedy
output token-identical to the single-process engine (which equals transformers,
tests/test_parallel_engine.py), with every stage's flow to every rank closed, the right
bytes per stage and ops of at most 8 MiB.

CI runs PP2 -> TP2 x DCP2 and PP1 -> TP2 x DCP1 (and the router over both); the full grid
PP {1, 2, 4} x (TP, DCP) {(1,1), (2,1), (2,2), (4,4)} is marked slow."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import openai
import pytest
import torch
from parallel_harness import (
    ParallelCluster,
    check_flows,
    flow_metrics,
    run_pair_batch,
    start_parallel_cluster,
)

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion
from protocol.parallel import even_layer_split
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(900)

NUM_LAYERS = 4
"""Layers of tests/conftest.py's tiny_parallel model."""
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PREFILLS = {
    "pp1": {"pipeline_parallel": 1},
    "pp2": {"pipeline_parallel": 2, "layer_split": [3, 1]},
    "pp4": {"pipeline_parallel": 4},
}
DECODES = {
    "tp1": {"tensor_parallel": 1, "decode_context_parallel": 1},
    "tp2": {"tensor_parallel": 2, "decode_context_parallel": 1},
    "tp2dcp2": {"tensor_parallel": 2, "decode_context_parallel": 2},
    "tp4dcp4": {"tensor_parallel": 4, "decode_context_parallel": 4},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 45, 100)]


@pytest.fixture(scope="module")
def completions(tiny_parallel_dir: Path, prompts, weights_cache_dir: str) -> list[Completion]:
    engine = LLMEngine.from_spec(str(tiny_parallel_dir), EngineConfig(cache_dir=weights_cache_dir))
    return engine.generate(prompts, PARAMS)


@pytest.fixture(scope="module")
def reference(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


def _cluster(tmp_path_factory, model: Path, cache_dir: str, prefill, decode):  # type: ignore[no-untyped-def]
    c = start_parallel_cluster(
        tmp_path_factory.mktemp("parallel"),
        str(model),
        cache_dir=cache_dir,
        prefill={k: PREFILLS[k] for k in prefill},
        decode={k: DECODES[k] for k in decode},
    )
    return c


@pytest.fixture(scope="module")
def ci_cluster(tmp_path_factory, tiny_parallel_dir: Path, weights_cache_dir: str):
    c = _cluster(
        tmp_path_factory, tiny_parallel_dir, weights_cache_dir, ["pp2", "pp1"], ["tp2dcp2", "tp2"]
    )
    yield c
    c.down()


@pytest.fixture(scope="module")
def grid_cluster(tmp_path_factory, tiny_parallel_dir: Path, weights_cache_dir: str):
    c = _cluster(tmp_path_factory, tiny_parallel_dir, weights_cache_dir, PREFILLS, DECODES)
    yield c
    c.down()


def _check_pair(c: ParallelCluster, prefill: str, decode: str, prompts, reference) -> None:  # type: ignore[no-untyped-def]
    before = flow_metrics(c.urls[prefill], c.urls[decode])
    results = run_pair_batch(
        c.urls[prefill], c.urls[decode], prompts, PARAMS, f"{prefill}-{decode}", c.headers
    )
    assert [r.tokens for r in results] == reference, f"{prefill} -> {decode}"
    (pp,), (tp, _) = c.layouts[prefill], c.layouts[decode]
    assert all(len(r.ready.landing) == tp for r in results)
    split = PREFILLS[prefill].get("layer_split") or even_layer_split(NUM_LAYERS, pp)
    # flows close after the tokens: wait until every stage's result is in the metrics
    deadline = time.monotonic() + 10
    while True:
        after = flow_metrics(c.urls[prefill], c.urls[decode])
        try:
            check_flows(before, after, results, tuple(split))
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize(("prefill", "decode"), [("pp2", "tp2dcp2"), ("pp1", "tp2")])
def test_pairs_match_single_process(ci_cluster, prefill, decode, prompts, reference):
    _check_pair(ci_cluster, prefill, decode, prompts, reference)


def test_router_over_parallel_instances(ci_cluster, prompts, completions):
    client = openai.OpenAI(base_url=ci_cluster.router_url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):  # round robin: every prefill and decode instance serves
        for p, want in zip(prompts, completions, strict=True):
            got = client.completions.create(
                model=ci_cluster.served_name,
                prompt=p,
                max_tokens=PARAMS.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert got.choices[0].text == want.text
            assert got.usage.completion_tokens == len(want.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize(("prefill", "decode"), list(itertools.product(PREFILLS, DECODES)))
def test_full_grid(grid_cluster, prefill, decode, prompts, reference):
    _check_pair(grid_cluster, prefill, decode, prompts, reference)

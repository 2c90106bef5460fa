"""End to end on a mixture-of-experts model: `kvserve up` with a shared pool on a tiny
random Glm4Moe (sigmoid grouped routing, shared expert, partial RoPE). Every request is
prefilled on the prefill instance and handed to the decode instance over Mooncake tcp;
after a prefix-cache reset the same prompt restores its full chunks from the pool. Greedy
output equals the single-process engine's, whose tokens transformers picks too."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_harness import Cluster, start_cluster
from model_e2e_check import check_handoff_and_pool_restore
from test_moe_model import make_tiny_moe

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tiny_tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp("glm4-moe")
    hf = make_tiny_moe(folder, "glm4_moe", tiny_tokenizer_dir, vocab_size=49152)
    return folder, hf


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moe, weights_cache_dir: str):
    c = start_cluster(
        tmp_path_factory.mktemp("e2e-moe"), str(moe[0]), cache_dir=weights_cache_dir, pool=True
    )
    yield c
    res = c.down()
    assert res.returncode == 0, res.stderr


def test_moe_handoff_and_pool_restore_match_single_process(
    cluster: Cluster, moe, weights_cache_dir: str
) -> None:
    folder, hf = moe
    words = ["expert", "router", "token", "pool"]
    check_handoff_and_pool_restore(cluster, folder, hf, words, weights_cache_dir)

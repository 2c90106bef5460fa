"""protocol/parallel.py layouts and the checks of layouts against the model, with the key
path every error names (`kvserve check` prints them)."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.launcher import check
from protocol.cluster import parse_cluster
from protocol.cluster_model_checks import check_model_layouts
from protocol.config_errors import ConfigError
from protocol.parallel import (
    decode_rank_shards,
    even_layer_split,
    head_layout_error,
    landing_region_max,
    layer_split_error,
    split_range,
    stage_layer_ranges,
    stripe_len,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local-parallel.yaml"


class Shape:
    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads


def test_even_split_and_ranges() -> None:
    assert even_layer_split(30, 4) == (8, 8, 7, 7)
    assert even_layer_split(4, 4) == (1, 1, 1, 1)
    assert stage_layer_ranges((20, 20, 20, 18)) == [(0, 20), (20, 40), (40, 60), (60, 78)]
    assert layer_split_error((15, 15), 30) is None
    assert "sum to 30" in (layer_split_error((15, 14), 30) or "")
    for n, parts in itertools.product(range(1, 20), range(1, 6)):
        ranges = [split_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_stripe_len_counts_the_stripe() -> None:
    for start, end, size in itertools.product(range(6), range(12), (1, 2, 3, 4)):
        for rank in range(size):
            want = sum(1 for t in range(start, end) if t % size == rank)
            assert stripe_len(start, end, size, rank) == want


@pytest.mark.parametrize(
    ("hq", "hkv", "tp", "dcp"),
    [(8, 4, 1, 1), (8, 4, 2, 1), (8, 4, 2, 2), (8, 4, 4, 4), (8, 4, 4, 1), (8, 2, 4, 1),
     (8, 2, 8, 2), (9, 3, 2, 2), (9, 3, 3, 1), (32, 8, 8, 4)],
)  # fmt: skip
def test_shards_cover_every_head_once_and_groups_share_kv(hq, hkv, tp, dcp) -> None:
    shards = decode_rank_shards(hq, hkv, tp, dcp)
    owned = sorted(h for s in shards for h in range(s.q_head_start, s.q_head_end))
    assert owned == list(range(hq))  # each query head's output is owned by one rank
    per_kv = hq // hkv
    for s in shards:
        group = [x for x in shards if x.group == s.group]
        assert len(group) == dcp and sorted(x.dcp_rank for x in group) == list(range(dcp))
        assert {(x.kv_head_start, x.kv_head_end) for x in group} == {
            (s.kv_head_start, s.kv_head_end)
        }
        for h in range(s.group_q_start, s.group_q_end):  # every query head finds its KV here
            assert s.kv_head_start <= h // per_kv < s.kv_head_end
        assert s.group_q_start <= s.q_head_start <= s.q_head_end <= s.group_q_end
    assert len({s.num_kv_heads for s in shards}) == 1  # same cache shape on every rank


def test_replicated_kv_heads_when_groups_outnumber_them() -> None:
    shards = decode_rank_shards(8, 2, 4, 1)
    assert [(s.kv_head_start, s.kv_head_end) for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_smollm2_heads() -> None:
    a, b = decode_rank_shards(9, 3, 2, 2)
    assert (a.kv_head_start, a.kv_head_end, b.kv_head_start, b.kv_head_end) == (0, 3, 0, 3)
    assert (a.q_head_start, a.q_head_end, b.q_head_start, b.q_head_end) == (0, 5, 5, 9)
    assert head_layout_error(9, 3, 2, 1) is not None
    with pytest.raises(ValueError, match="KV-head groups"):
        decode_rank_shards(9, 3, 2, 1)


def _cluster(**changes: Any):  # type: ignore[no-untyped-def]
    data = yaml.safe_load(EXAMPLE.read_text())
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][0][field] = value
    return parse_cluster(data)


@pytest.mark.parametrize(
    ("changes", "path", "message"),
    [
        ({"prefill__layer_split": [16, 15]}, "prefill[0].layer_split", "must sum to 30"),
        (
            {"prefill__layer_split": None, "prefill__pipeline_parallel": 31,
             "prefill__devices": ["cpu"] * 31},
            "prefill[0].pipeline_parallel",
            "at most 30",
        ),
        ({"decode__decode_context_parallel": 1}, "decode[0].tensor_parallel", "KV-head groups"),
    ],
)  # fmt: skip
def test_model_checks_name_the_key(changes, path, message) -> None:
    with pytest.raises(ConfigError) as e:
        check_model_layouts(_cluster(**changes), Shape(30, 9, 3))
    assert e.value.path == path and message in e.value.message


def test_dcp_must_be_a_power_of_two() -> None:
    with pytest.raises(ConfigError) as e:
        _cluster(
            decode__tensor_parallel=6,
            decode__decode_context_parallel=3,
            decode__devices=["cpu"] * 6,
        )
    assert e.value.path == "decode[0].decode_context_parallel"


def test_kvserve_check_reads_the_model(tmp_path: Path) -> None:
    out = io.StringIO()
    assert check(EXAMPLE, out) == 0
    assert "layouts  fit the model: 30 layers" in out.getvalue()
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["prefill"][0]["layer_split"] = [20, 20]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"prefill\[0\]\.layer_split: \[20, 20\] covers 40"):
        check(path, io.StringIO())


class FullShape(Shape):
    """What the landing check also needs: head_dim and the context length."""

    def __init__(self) -> None:
        super().__init__(30, 9, 3)
        self.head_dim, self.max_position_embeddings = 64, 8192


def test_landing_must_stream_the_full_context() -> None:
    """A region is a quarter of the landing buffer and must hold two tokens of every layer
    of the rank (SmolLM2 float32 at TP2 x DCP2: 23 KB per token on a rank)."""
    ok = _cluster(decode__landing_memory="1MiB")
    check_model_layouts(ok, FullShape())  # 256 KiB regions stream any context
    with pytest.raises(ConfigError) as e:
        check_model_layouts(_cluster(decode__landing_memory="64KiB"), FullShape())
    assert e.value.path == "decode[0].landing_memory"
    assert "8192-token context" in e.value.message and "raise it" in e.value.message


def test_landing_region_sets_the_cap_and_is_checked() -> None:
    """`landing_region` replaces the quarter: more, smaller regions (more requests between
    /decode and their prompt landed at once), each still two tokens of every layer."""
    assert landing_region_max(1 << 20) == 256 << 10  # default: a quarter
    assert landing_region_max(1 << 20, 128 << 10) == 128 << 10
    assert landing_region_max(1 << 20, 4 << 20) == 1 << 20  # never more than the buffer
    check_model_layouts(
        _cluster(decode__landing_memory="1MiB", decode__landing_region="128KiB"), FullShape()
    )
    with pytest.raises(ConfigError) as e:
        check_model_layouts(
            _cluster(decode__landing_memory="1MiB", decode__landing_region="16KiB"), FullShape()
        )
    assert e.value.path == "decode[0].landing_region"
    assert "raise landing_region" in e.value.message


def test_kvserve_check_reports_how_the_context_lands() -> None:
    out = io.StringIO()
    assert check(str(EXAMPLE), out=out) == 0
    text = out.getvalue()
    assert "a 8192-token context is 180MiB per rank; region 32MiB: streams through it" in text

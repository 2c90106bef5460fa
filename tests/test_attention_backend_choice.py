"""cluster.yaml's attention_backend: what every engine process of a cluster runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from enginehost.startup import engine_config
from protocol.cluster import load_cluster
from protocol.config_errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _cluster(tmp_path: Path, extra: str = "") -> object:
    text = (REPO / "deploy" / "examples" / "local.yaml").read_text() + extra
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_cluster(path)


@pytest.mark.parametrize(("device", "backend"), [("cpu", "cpu"), (0, "flex"), (3, "flex")])
def test_auto_is_flex_on_gpus_and_cpu_on_cpus(tmp_path: Path, device: object, backend: str) -> None:
    cluster = _cluster(tmp_path)
    assert cluster.attention_backend == "auto"  # type: ignore[attr-defined]
    config = engine_config(cluster, device=device, kv_cache_bytes=1 << 20, max_num_seqs=4)  # type: ignore[arg-type]
    assert config.attention_backend == backend


def test_an_explicit_backend_is_kept(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, "attention_backend: torch\n")
    config = engine_config(cluster, device=0, kv_cache_bytes=1 << 20, max_num_seqs=4)  # type: ignore[arg-type]
    assert config.attention_backend == "torch"


def test_an_unknown_backend_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="attention_backend"):
        _cluster(tmp_path, "attention_backend: triton\n")

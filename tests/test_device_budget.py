"""GPU sharing and memory budgets (protocol/device_budget.py, kvserve check): CPU only.

Several instances on one GPU need the node's explicit `share_devices: true`; then every
instance's budget (weights + kv_cache_memory + landing or staging + workspace, or the
stated gpu_memory_budget) on the device must fit its memory, else a ConfigError names the
device and the instances. A cuda_ipc handoff needs GPUs on one host.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.gpu_probe import parse_nvidia_smi
from kvserve.launcher import check_gpus
from modelinfo.config import ModelConfig
from protocol.cluster import ClusterConfig, parse_cluster
from protocol.config_errors import ConfigError
from protocol.device_budget import GiB, check_device_budgets, device_uses

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "deploy" / "examples" / "single-gpu.yaml"
LLAMA_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)


def _example() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return data


def _cluster(data: dict[str, Any]) -> ClusterConfig:
    return parse_cluster(copy.deepcopy(data), "single-gpu.yaml")


def test_single_gpu_example_fits_one_h200_with_the_parts_named():
    c = _cluster(_example())
    uses = {u.path: u for u in device_uses(c, LLAMA_8B)}
    assert set(uses) == {"prefill[0]", "decode[0]"}
    assert {u.device for u in uses.values()} == {"cuda:0"}
    weights = dict(uses["decode[0]"].parts)["weights"]
    assert 14 * GiB < weights < 16 * GiB  # 8.0B parameters in bf16
    assert dict(uses["decode[0]"].parts)["landing_memory"] == 12 * GiB  # on the GPU: cuda_ipc
    assert dict(uses["prefill[0]"].parts)["handoff staging"] == 1 * GiB
    (line,) = check_device_budgets(c, LLAMA_8B)
    assert "cuda:0" in line and "prefill-0" in line and "decode-0" in line and "of 140GiB" in line


def test_an_oversubscribed_gpu_is_refused_naming_the_device_and_instances():
    data = _example()
    data["nodes"][0]["gpu_memory"] = "100GiB"
    c = _cluster(data)
    with pytest.raises(ConfigError) as info:
        check_device_budgets(c, LLAMA_8B)
    err = info.value
    assert err.path == "nodes[0]"
    for part in ("cuda:0", "prefill[0] prefill-0", "decode[0] decode-0", "100GiB"):
        assert part in err.message
    assert "kv_cache_memory" in err.message  # what to change


def test_sharing_a_gpu_needs_the_explicit_opt_in():
    data = _example()
    del data["nodes"][0]["share_devices"]
    with pytest.raises(ConfigError) as info:
        _cluster(data)
    assert info.value.path == "decode[0].devices[0]"
    assert "share_devices: true" in info.value.message
    assert "prefill[0].devices[0]" in info.value.message


def test_a_stated_budget_replaces_the_derived_one():
    data = _example()
    data["decode"][0]["gpu_memory_budget"] = "80GiB"
    c = _cluster(data)
    uses = {u.path: u for u in device_uses(c, LLAMA_8B)}
    assert uses["decode[0]"].budget_bytes == 80 * GiB
    assert uses["decode[0]"].parts == (("stated", 80 * GiB),)
    check_device_budgets(c, LLAMA_8B)  # ~50.6 GiB of prefill + 80 GiB fit 140 GiB
    data["decode"][0]["gpu_memory_budget"] = "95GiB"
    with pytest.raises(ConfigError, match=r"decode-0 \(95GiB\).*more than its 140GiB"):
        check_device_budgets(_cluster(data), LLAMA_8B)


def test_probed_memory_is_used_when_the_node_does_not_state_it():
    data = _example()
    del data["nodes"][0]["gpu_memory"]
    c = _cluster(data)
    (unknown,) = check_device_budgets(c, LLAMA_8B)
    assert "not checked" in unknown
    with pytest.raises(ConfigError, match="more than its 80GiB"):
        check_device_budgets(c, LLAMA_8B, {"gpu0": {"cuda:0": 80 * GiB}})
    (ok,) = check_device_budgets(c, LLAMA_8B, {"gpu0": {"cuda:0": 141 * GiB}})
    assert "of 141GiB" in ok


def test_kvserve_check_checks_only_shared_gpus():
    data = _example()
    data["nodes"][0]["gpu_memory"] = "100GiB"
    with pytest.raises(ConfigError, match="cuda:0 of node gpu0"):
        check_gpus(_cluster(data), LLAMA_8B)
    data["decode"][0]["devices"] = [1]
    data["nodes"][0]["gpu_memory"] = "60GiB"
    assert check_gpus(_cluster(data), LLAMA_8B) == []  # nothing shared: nothing to sum


def test_prefill_stages_carry_their_layers_and_the_embeddings_where_they_live():
    data = _example()
    data["prefill"][0].update(devices=[0, 1], pipeline_parallel=2, layer_split=[20, 12])
    uses = [u for u in device_uses(_cluster(data), LLAMA_8B) if u.path == "prefill[0]"]
    w0, w1 = (dict(u.parts)["weights"] for u in uses)
    assert [u.device for u in uses] == ["cuda:0", "cuda:1"]
    embed = 128256 * 4096 * 2
    assert w0 > w1 > embed  # 20 layers + embeddings vs 12 layers + LM head


@pytest.mark.parametrize(
    "change, match",
    [
        ({"prefill": {"devices": ["cpu"]}}, "runs on cpu"),
        ({"nodes": "second-host"}, "one host"),
    ],
    ids=["cpu-instance", "two-hosts"],
)
def test_cuda_ipc_needs_gpus_on_one_host(change: dict[str, Any], match: str):
    data = _example()
    if "prefill" in change:
        data["prefill"][0].update(change["prefill"])
        data["nodes"][0]["share_devices"] = False
    else:
        data["nodes"].append({"name": "other", "host": "10.0.0.2"})
        data["prefill"][0]["node"] = "other"
    with pytest.raises(ConfigError, match=match) as info:
        _cluster(data)
    assert info.value.path == "decode[0].transfer.protocol"


def test_every_decode_uses_the_same_handoff_protocol():
    data = _example()
    second = dict(data["decode"][0], name="decode-1", port=8201, devices=[1])
    second["transfer"] = {"protocol": "tcp"}
    data["decode"].append(second)
    with pytest.raises(ConfigError, match="one handoff transport") as info:
        _cluster(data)
    assert info.value.path == "decode[1].transfer.protocol"


def test_nvidia_smi_output_is_read_per_gpu():
    out = "0, 143771\n1, 143771\nNo devices were found\n"
    assert parse_nvidia_smi(out) == {"cuda:0": 143771 << 20, "cuda:1": 143771 << 20}
    assert parse_nvidia_smi("") == {}


def test_kvserve_check_refuses_the_oversubscribed_example(tmp_path: Path):
    """`kvserve check` reads the model's config.json (nothing loaded) and sums the GPU."""
    import io
    import json

    from benchmarks.random_model import LLAMA_3_8B
    from kvserve.launcher import check

    model = tmp_path / "llama-8b"
    model.mkdir()
    config = dict(LLAMA_3_8B, architectures=["LlamaForCausalLM"], model_type="llama")
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").touch()
    (model / "tokenizer.json").write_text("{}")
    data = _example()
    data["model"] = str(model)
    path = tmp_path / "single-gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    out = io.StringIO()
    assert check(path, out) == 0
    assert "gpu      gpu0 cuda:0: prefill[0] prefill-0" in out.getvalue()
    data["nodes"][0]["gpu_memory"] = "80GiB"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="cuda:0 of node gpu0 holds") as info:
        check(path, io.StringIO())
    assert info.value.path == "nodes[0]" and "single-gpu.yaml" in str(info.value)

"""cluster.yaml: the examples validate; every kind of mistake names its key path."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from protocol.cluster import (
    ClusterConfig,
    load_cluster,
    local_nodes,
    parse_cluster,
    parse_cluster_yaml,
)
from protocol.cluster_types import ByteSize, enc_hook, format_bytes, parse_byte_size
from protocol.config_errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
LOCAL = REPO / "deploy" / "examples" / "local-pd.yaml"


def local_dict() -> dict[str, Any]:
    return yaml.safe_load(LOCAL.read_text())


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"local.yaml", "single-server-8gpu.yaml", "four-server.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path: Path) -> None:
    cluster = load_cluster(path)
    assert isinstance(cluster, ClusterConfig)
    # What a component sees after a round trip through JSON is the same config.
    raw = msgspec.json.decode(msgspec.json.encode(cluster, enc_hook=enc_hook))
    assert parse_cluster(raw) == cluster


def test_local_example() -> None:
    c = load_cluster(LOCAL)
    assert c.model == "builtin:smollm2-135m-instruct"
    assert c.dtype == "bfloat16" and c.cpu_pinning  # the fast CPU path
    assert [n.host for n in c.nodes] == ["127.0.0.1"]
    assert len(c.prefill) == 1 and len(c.decode) == 1
    assert c.prefill[0].device_names == ("cpu",)
    assert c.pool is not None and c.pool.enabled and c.pool_enabled and c.pool.shared
    assert [s.numa_node for s in c.pool.stores] == [0, 1]  # two stores, as two NUMA nodes
    assert c.api_base_url == "http://127.0.0.1:8000/v1"
    assert c.prefill[0].kv_cache_memory == 512 * 1024**2
    assert c.decode[0].landing_memory == 256 * 1024**2
    assert [n.name for n in local_nodes(c)] == ["local"]
    assert c.prefill_instance("prefill-0") is c.prefill[0]
    assert c.decode_instance("decode-0") is c.decode[0]
    assert c.instance("decode-0") is c.decode[0]
    assert c.instance_url(c.decode[0]) == "http://127.0.0.1:8200"


def test_gpu_examples() -> None:
    one = load_cluster(REPO / "deploy" / "examples" / "single-server-8gpu.yaml")
    (p,) = one.prefill
    (d,) = one.decode
    assert p.pipeline_parallel == 4 and p.device_names == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert (d.tensor_parallel, d.decode_context_parallel) == (4, 4)
    assert d.device_names == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    four = load_cluster(REPO / "deploy" / "examples" / "four-server.yaml")
    assert (len(four.nodes), len(four.prefill), len(four.decode)) == (4, 6, 2)
    assert four.pool is not None and four.pool.shared and len(four.pool.stores) == 8
    assert four.router_bind_host == "0.0.0.0"
    assert four.router_url == "http://10.0.0.1:8000"  # the wildcard is reached via the node


def test_lookups_name_the_valid_choices() -> None:
    c = load_cluster(LOCAL)
    with pytest.raises(ConfigError, match="prefill: prefill-0"):
        c.prefill_instance("nope")
    with pytest.raises(ConfigError, match="decode: decode-0"):
        c.decode_instance("prefill-0")
    with pytest.raises(ConfigError, match="nodes: local"):
        c.node("gpu9")


def test_config_is_frozen() -> None:
    c = load_cluster(LOCAL)
    with pytest.raises(AttributeError):
        c.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        c.decode[0].tensor_parallel = 2  # type: ignore[misc]


def _set(path: str, value: Any):  # type: ignore[no-untyped-def]
    """A mutation of the local example: set a dotted path like decode.0.port."""

    def mutate(d: dict[str, Any]) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in parents:
            d = d[k]
        d[last] = value  # type: ignore[index]

    return mutate


def _del(path: str):  # type: ignore[no-untyped-def]
    def mutate(d: dict[str, Any]) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in parents:
            d = d[k]
        del d[last]  # type: ignore[arg-type]

    return mutate


def _tp4(dcp: int):  # type: ignore[no-untyped-def]
    def mutate(d: dict[str, Any]) -> None:
        d["decode"][0].update(tensor_parallel=4, decode_context_parallel=dcp, devices=[4, 5, 6, 7])

    return mutate


BAD = [
    # unknown keys, at every depth
    ("top", _set("colour", "blue"), "colour", "unknown key; valid keys: name, model"),
    ("nested", _set("decode.0.tensor_paralel", 2), "decode[0].tensor_paralel", "tensor_parallel"),
    ("deep", _set("router.admission.timeout", 1), "router.admission.timeout", "wait_timeout_s"),
    # bad values
    ("type", _set("decode.0.tensor_parallel", "2"), "decode[0].tensor_parallel", "integer >= 1"),
    ("zero", _set("decode.0.tensor_parallel", 0), "decode[0].tensor_parallel", "got 0"),
    ("enum", _set("dtype", "int4"), "dtype", "float32, bfloat16, float16"),
    ("policy", _set("router.policy", "best"), "router.policy", "round_robin, random, session"),
    (
        "proto",
        _set("decode.0.transfer.protocol", "udp"),
        "decode[0].transfer.protocol",
        "tcp, rdma",
    ),
    ("port", _set("router.port", 70000), "router.port", "1-65535"),
    ("port0", _set("prefill.0.port", 0), "prefill[0].port", "1-65535"),
    ("size", _set("prefill.0.kv_cache_memory", "lots"), "prefill[0].kv_cache_memory", "512MiB"),
    ("size0", _set("decode.0.landing_memory", 0), "decode[0].landing_memory", "larger than 0"),
    ("region", _set("decode.0.landing_region", "1GiB"), "decode[0].landing_region", "more than"),
    ("region0", _set("decode.0.landing_region", 0), "decode[0].landing_region", "larger than 0"),
    ("region-ok", _set("decode.0.landing_region", "64MiB"), None, None),  # valid
    ("ratio", _set("router.admission.headroom", 1.5), "router.admission.headroom", "(0, 1]"),
    ("adm-order", _set("router.admission.order", "lifo"), "router.admission.order", "fits_first"),
    ("adm-bound", _set("router.admission.pass_bound_s", 0), "router.admission.pass_bound_s", "> 0"),
    ("fits-first", _set("router.admission.order", "fits_first"), None, None),  # valid
    ("name", _set("prefill.0.name", "my prefill"), "prefill[0].name", "letters, digits"),
    ("missing", _del("decode.0.port"), "decode[0].port", "required key is missing"),
    ("no-decode", _set("decode", []), "decode", "at least one decode instance"),
    ("chunk", _set("cache.chunk_size", 100), "cache.chunk_size", "multiple of block_size 16"),
    ("order", _set("cache.prefill_order", "lifo"), "cache.prefill_order", "shortest, fcfs"),
    ("bound", _set("cache.prefill_bound_steps", 0), "cache.prefill_bound_steps", ">= 1"),
    ("fcfs", _set("cache.prefill_order", "fcfs"), None, None),  # valid
    (
        "admission",
        _set("cache.prefill_admission", "eager"),
        "cache.prefill_admission",
        "whole_prompt, chunk",
    ),
    ("chunk-admission", _set("cache.prefill_admission", "chunk"), None, None),  # valid
    ("stall", _set("engine_stall_timeout_s", 0), "engine_stall_timeout_s", "> 0"),
    ("no-stall", _set("engine_stall_timeout_s", None), None, None),  # valid: watchdog off
    (
        "hang",
        _set("decode.0.engine_faults", {"fail_seed": 1, "hang_s": -1}),
        "decode[0].engine_faults.hang_s",
        ">= 0",
    ),
    ("wildcard", _set("nodes.0.host", "0.0.0.0"), "nodes[0].host", "wildcard"),
    ("auth", _set("router.api_key_env", "K"), None, None),  # valid alone
    ("open-router", _set("router.host", "0.0.0.0"), "router.host", "needs router.api_key"),
    # references and names
    (
        "node-ref",
        _set("decode.0.node", "gpu9"),
        "decode[0].node",
        "unknown node 'gpu9'; nodes: local",
    ),
    ("router-ref", _set("router.node", "gpu9"), "router.node", "unknown node"),
    ("pool-ref", _set("pool.stores.0.node", "x"), "pool.stores[0].node", "unknown node"),
    ("store-size", _set("pool.stores.0.size", "8MiB"), "pool.stores[0].size", "below 16MiB"),
    ("dup-name", _set("decode.0.name", "prefill-0"), "decode[0].name", "also prefill[0].name"),
    ("reserved", _set("decode.0.name", "router"), "decode[0].name", "reserved"),
    # parallel layouts
    ("dcp", _tp4(3), "decode[0].decode_context_parallel", "does not divide tensor_parallel 4"),
    ("dcp-ok", _tp4(2), None, None),
    ("tp-devices", _set("decode.0.tensor_parallel", 2), "decode[0].devices", "tensor_parallel 2"),
    (
        "pp-devices",
        _set("prefill.0.pipeline_parallel", 2),
        "prefill[0].devices",
        "one device per stage",
    ),
    (
        "split",
        _set("prefill.0.layer_split", [10, 20]),
        "prefill[0].layer_split",
        "pipeline_parallel 1",
    ),
    ("device", _set("prefill.0.devices", ["tpu0"]), "prefill[0].devices[0]", "cuda:N"),
    # ports on one host
    ("collision", _set("decode.0.port", 8100), "decode[0].port", "also prefill[0].port"),
    ("metrics", _set("router.metrics_port", 8000), "router.metrics_port", "also router.port"),
    ("processes", _set("router.processes", 2), "router.metrics_port", "set metrics_port"),
    ("no-processes", _set("router.processes", 0), "router.processes", ">= 1"),
    ("health-every", _set("router.health_interval_s", 0), "router.health_interval_s", "> 0"),
    (
        "health-faster-than-timeout",
        _set("router.health_interval_s", 0.5),
        "router.health_interval_s",
        "0.5 is below router.health_timeout_s (1)",
    ),
    ("health-every-5s", _set("router.health_interval_s", 5), None, None),  # valid
    # Mooncake's engines bind RPC ports at random in 15000-17000
    ("mooncake-range", _set("decode.0.port", 16000), "decode[0].port", "inside 15000-17000"),
    ("mooncake-top", _set("router.port", 17000), "router.port", "inside 15000-17000"),
    # ... and its pool clients take a transfer port at random in 12300-14300
    ("mooncake-client", _set("router.port", 12885), "router.port", "inside 12300-14300"),
    ("mooncake-above", _set("router.port", 17001), None, None),  # valid
]


def _all_cases() -> list[tuple[str, Any, str | None, str | None]]:
    """BAD plus the cases that need more than one key changed."""
    cases = list(BAD)

    def two_gpus(d: dict[str, Any]) -> None:
        d["decode"][0].update(tensor_parallel=2, devices=[3, "cuda:3"])

    def mixed(d: dict[str, Any]) -> None:
        d["prefill"][0].update(pipeline_parallel=2, devices=[0, "cpu"])

    def shared(d: dict[str, Any]) -> None:
        d["prefill"][0]["devices"] = [1]
        d["decode"].append(
            {**d["decode"][0], "name": "decode-1", "port": 8201, "devices": ["cuda:1"]}
        )

    def pool_on(d: dict[str, Any]) -> None:
        d["pool"]["enabled"] = True
        d["pool"]["master"]["port"] = 8000

    def pool_off(d: dict[str, Any]) -> None:
        d["pool"]["enabled"] = False
        d["pool"]["master"]["port"] = 8000

    def mooncake_moved(d: dict[str, Any]) -> None:  # the range moved: 16000 is fine
        d["decode"][0].update(port=16000, env={"MC_MIN_RPC_PORT": "20000"})

    def two_routers(port: int) -> Any:
        def mutate(d: dict[str, Any]) -> None:
            d["router"].update(processes=2, metrics_port=port)

        return mutate

    cases += [
        ("two-routers", two_routers(9100), None, None),  # valid: 9100 and 9101
        (
            "router-metrics",
            two_routers(8099),  # process 1's metrics on 8100, prefill-0's port
            "prefill[0].port",
            "also router.metrics_port (+1, router process 1)",
        ),
        ("dup-gpu", two_gpus, "decode[0].devices[1]", "cuda:3 is listed twice"),
        ("mixed", mixed, "prefill[0].devices", "mixes cpu and GPUs"),
        ("shared-gpu", shared, "decode[1].devices[0]", "cuda:1 on host 127.0.0.1 is already used"),
        ("pool-collision", pool_on, "pool.master.port", "also router.port"),
        ("pool-port", pool_off, None, None),  # disabled pool: no port
        ("mooncake-moved", mooncake_moved, None, None),
    ]
    return cases


@pytest.mark.parametrize(
    ("case", "mutate", "path", "fragment"),
    _all_cases(),
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_mistakes_name_the_key_path(
    case: str, mutate: Any, path: str | None, fragment: str | None
) -> None:
    data = local_dict()
    mutate(data)
    if path is None:
        parse_cluster(copy.deepcopy(data))  # valid
        return
    with pytest.raises(ConfigError) as info:
        parse_cluster(data, "cluster.yaml")
    err = info.value
    assert err.path == path, str(err)
    assert fragment is not None and fragment in str(err), str(err)
    assert str(err).startswith(f"cluster.yaml: {path}: ")


def test_yaml_level_mistakes() -> None:
    with pytest.raises(ConfigError, match="'model' given twice"):
        parse_cluster_yaml(LOCAL.read_text() + "\nmodel: other\n")
    with pytest.raises(ConfigError, match="mapping of keys at top level"):
        parse_cluster_yaml("- a\n- b\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_cluster_yaml("name: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read the cluster file"):
        load_cluster("/nonexistent/cluster.yaml")


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        (512, 512),
        ("512MiB", 512 * 1024**2),
        ("1GiB", 1024**3),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("4GB", 4 * 10**9),
        ("64kib", 65536),
        ("100B", 100),
        ("7", 7),
    ],
)
def test_byte_sizes(text: object, num_bytes: int) -> None:
    size = parse_byte_size(text)
    assert isinstance(size, ByteSize) and size == num_bytes


@pytest.mark.parametrize("text", ["", "1.5", "GiB", "-1", -1, True, 1.5, "1 parsec", "0.3B"])
def test_bad_byte_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(text)


def test_format_bytes() -> None:
    assert format_bytes(512 * 1024**2) == "512MiB"
    assert format_bytes(3 * 1024**3 // 2) == "1.5GiB"
    assert format_bytes(100) == "100B"


def test_local_nodes_skips_other_machines() -> None:
    data = local_dict()
    data["nodes"].append({"name": "remote", "host": "192.0.2.7"})  # TEST-NET-1, never local
    data["decode"][0]["node"] = "remote"
    data["auth"] = {"secret_env": "KVSERVE_SHARED_SECRET"}  # two hosts share one
    c = parse_cluster(data)
    assert [n.name for n in local_nodes(c)] == ["local"]
    assert c.instance_url(c.decode[0]) == "http://192.0.2.7:8200"


def test_cluster_loading_is_torch_free() -> None:
    code = (
        "import sys; from protocol.cluster import load_cluster; "
        f"load_cluster({str(LOCAL)!r}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def _kvserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_cli_valid() -> None:
    res = _kvserve("check", "-c", str(LOCAL))
    assert res.returncode == 0, res.stderr
    assert "cluster 'local' is valid" in res.stdout
    assert "http://127.0.0.1:8000/v1" in res.stdout
    assert "prefill-0" in res.stdout and "decode-0" in res.stdout
    assert (
        "here     pool-master, pool-store-0, pool-store-1, router, prefill-0, decode-0"
        in res.stdout
    )


def test_check_cli_invalid(tmp_path: Path) -> None:
    data = local_dict()
    data["decode"][0].update(tensor_parallel=4, decode_context_parallel=3, devices=[0, 1, 2, 3])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = _kvserve("check", "-c", str(bad))
    assert res.returncode == 2
    assert res.stdout == ""
    assert "decode[0].decode_context_parallel: 3 does not divide tensor_parallel 4" in res.stderr
    res = _kvserve("check", "-c", str(tmp_path / "missing.yaml"))
    assert res.returncode == 2 and "cannot read" in res.stderr


def test_check_cli_default_is_local_example() -> None:
    res = _kvserve("check")
    assert res.returncode == 0 and "cluster 'local' is valid" in res.stdout

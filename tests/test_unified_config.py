"""The unified topology's configuration and routing, CPU logic only: cluster.yaml's
`unified:` section and its checks, the CPU plan and GPU budget of its one process, the
components `kvserve up` starts, the router's settings, and the routing policies choosing
among unified instances."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from enginehost.cpu_plan import CpuSlot, plan_slot
from kvserve.components import plan_components
from kvserve.prometheus_config import scrape_targets
from modelinfo.config import ModelConfig
from protocol.cluster import ClusterConfig, parse_cluster
from protocol.config_errors import ConfigError
from protocol.device_budget import check_device_budgets, device_uses
from protocol.hashing import chunk_keys, hash_chain, namespace_seed
from protocol.kv_events import KVEvent, KVEventBatch, WorkerInfo, WorkerLoad
from router.cluster_view import ClusterView
from router.config import settings_from_cluster
from router.instances import Instance, InstanceRegistry
from router.kv_aware import KVAwarePolicy, SessionPolicy
from router.policies import RoundRobinPolicy, RouteContext

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "deploy" / "examples" / "local.yaml"
LOCAL_PD = ROOT / "deploy" / "examples" / "local-pd.yaml"
MODEL = ModelConfig(
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


def _raw() -> dict[str, Any]:
    return yaml.safe_load(LOCAL.read_text())


def _parse(raw: dict[str, Any]) -> ClusterConfig:
    return parse_cluster(raw)


def test_the_embedded_default_is_one_unified_instance_and_pd_has_its_own_example() -> None:
    c = _parse(_raw())
    assert not c.disaggregated and not c.prefill and not c.decode
    (u,) = c.unified
    assert u.devices == ("cpu",) and c.pool_enabled
    pd = parse_cluster(yaml.safe_load(LOCAL_PD.read_text()))
    assert pd.disaggregated and len(pd.prefill) == 1 and len(pd.decode) == 1 and not pd.unified
    assert pd.dtype == c.dtype and pd.pool == c.pool and pd.model == c.model


@pytest.mark.parametrize(
    ("edit", "path", "words"),
    [
        (lambda r: r.update(prefill=yaml.safe_load(LOCAL_PD.read_text())["prefill"]), "prefill",
         "not both"),
        (lambda r: r.pop("unified"), "prefill", "unified instances instead"),
        (lambda r: r["unified"][0].update(devices=["cpu", "cpu"]), "unified[0].devices",
         "exactly one device"),
        (lambda r: r["unified"][0].update(devices=["tpu"]), "unified[0].devices[0]",
         "is not a device"),
        (lambda r: r["unified"][0].update(port=r["router"]["port"]), "unified[0].port",
         "router.port"),
        (lambda r: r["unified"][0].update(name="router"), "unified[0].name", "reserved"),
        (lambda r: r["unified"][0].update(pipeline_parallel=2), "unified[0]",
         "pipeline_parallel"),
        (lambda r: r["unified"][0].update(kv_cache_memory=0), "unified[0].kv_cache_memory",
         "larger than 0"),
    ],
)  # fmt: skip
def test_bad_unified_sections_name_the_key(edit, path: str, words: str) -> None:  # type: ignore[no-untyped-def]
    raw = _raw()
    edit(raw)
    with pytest.raises(ConfigError) as e:
        _parse(raw)
    assert e.value.path.startswith(path), e.value
    assert words in str(e.value)


def test_one_unified_process_takes_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CPU, all threads for steps with prefill rows, one fewer for pure decode."""
    monkeypatch.delenv("KVSERVE_CPU_DECODE_THREADS", raising=False)
    c = _parse(_raw())
    assert plan_slot(c, "local", "unified-0", 0, cpus=[0, 1]) == CpuSlot((0, 1), 2, 1)
    raw = _raw()
    raw["unified"].append({**raw["unified"][0], "name": "unified-1", "port": 8101})
    two = _parse(raw)
    assert plan_slot(two, "local", "unified-0", 0, cpus=[0, 1, 2, 3]) == CpuSlot((0, 1), 2, 1)
    assert plan_slot(two, "local", "unified-1", 0, cpus=[0, 1, 2, 3]) == CpuSlot((2, 3), 2, 1)


def test_gpu_budget_of_a_unified_instance() -> None:
    raw = _raw()
    raw["nodes"][0]["gpu_memory"] = "80GiB"
    raw["unified"][0].update(devices=[0], kv_cache_memory="20GiB")
    c = _parse(raw)
    (use,) = device_uses(c, MODEL)
    parts = dict(use.parts)
    assert use.device == "cuda:0" and parts["kv_cache_memory"] == 20 * 1024**3
    assert parts["weights"] > 14 * 1024**3  # the whole 8B model in bf16, in one process
    assert check_device_budgets(c, MODEL)
    raw["unified"][0]["kv_cache_memory"] = "70GiB"
    with pytest.raises(ConfigError, match="more than its 80GiB"):
        check_device_budgets(_parse(raw), MODEL)
    raw["unified"][0]["kv_cache_memory"] = "20GiB"
    raw["unified"].append({**raw["unified"][0], "name": "unified-1", "port": 8101})
    with pytest.raises(ConfigError, match="share_devices"):
        _parse(raw)


def test_kvserve_up_starts_the_unified_worker_and_prometheus_scrapes_it(tmp_path: Path) -> None:
    c = _parse(_raw())
    stages = plan_components(c, LOCAL, ["local"])
    kinds = [[s.kind for s in stage] for stage in stages]
    assert kinds == [["pool_master"], ["pool_store", "pool_store"], ["unified", "router"]]
    worker, router = stages[2]
    assert router.waits_for == ("unified-0",)
    assert worker.argv[1:3] == ("-m", "unified_worker") and worker.name == "unified-0"
    roles = {t.kind for t in scrape_targets(c)}
    assert "unified" in roles and "prefill" not in roles


def test_router_settings_send_every_request_to_the_unified_instances() -> None:
    s = settings_from_cluster(_parse(_raw()))
    assert not s.prefill and not s.decode
    (u,) = s.unified
    assert u.name == "unified-0" and u.pool == "shared" and u.url.endswith(":8100")
    reg = InstanceRegistry([], [], [Instance("u0", "unified", "http://u0")])
    assert [i.name for i in reg.candidates("unified")] == ["u0"]
    assert reg.summary()["unified"]["total"] == 1


NS, BS, CS = "ns", 16, 256


def _view(n: int) -> tuple[ClusterView, list[Instance]]:
    insts = [Instance(f"u{i}", "unified", f"http://u{i}") for i in range(n)]
    view = ClusterView(pool_of={i.name: "shared" for i in insts})
    load = WorkerLoad(
        num_running=0,
        num_waiting=0,
        queued_tokens=0,
        kv_blocks_total=100,
        kv_blocks_free=100,
        compute_tokens_per_s=1000.0,
        restore_bytes_per_s=1e8,
    )
    for i in insts:
        info = WorkerInfo(
            name=i.name,
            role="unified",
            namespace_key=NS,
            block_size=BS,
            chunk_size=CS,
            kv_bytes_per_token=1000,
            kv_capacity_tokens=100_000,
        )
        view.set_info(i, info)
        view.apply_batch(i, KVEventBatch(epoch="e", next_seq=0, reset=True, load=load))
    return view, insts


def test_policies_choose_among_unified_instances() -> None:
    rng = random.Random(0)
    history = [rng.randrange(1, 50_000) for _ in range(3008)]
    prompt = history + [7] * 40
    view, insts = _view(3)
    root = namespace_seed(NS)
    st = view.state(insts[2])
    view.apply_batch(
        insts[2],
        KVEventBatch(
            epoch="e",
            next_seq=1,
            events=[KVEvent(0, "stored", list(hash_chain(history, BS, root)))],
            load=st.load,
        ),
    )
    ctx = RouteContext("r", prompt)
    policy = KVAwarePolicy(0, view)
    assert policy.choose("unified", ctx, insts) is insts[2]  # the prefix holder
    assert policy.last_prices["u2"].gpu_tokens == 3008
    # the pool holds another session's history: any instance restores it, priced so
    other = [rng.randrange(1, 50_000) for _ in range(2048)]
    view.pools["shared"].add(chunk_keys(hash_chain(other, BS, root), CS // BS))
    policy.choose("unified", RouteContext("s", other + [1] * 10), insts[:2])
    assert {p.pool_tokens for p in policy.last_prices.values()} == {2048}
    rr = RoundRobinPolicy()
    assert [rr.choose("unified", ctx, insts).name for _ in range(4)] == ["u0", "u1", "u2", "u0"]
    session = SessionPolicy(0, view)
    pinned = session.choose("unified", RouteContext("a", prompt, session_id="s1"), insts)
    again = session.choose("unified", RouteContext("b", prompt, session_id="s1"), insts)
    assert pinned is again


def test_a_unified_copy_of_the_pd_example_keeps_the_namespace() -> None:
    """Same model, dtype and cache granularity: both topologies hash KV alike (PP 1), so
    moving a deployment from one to the other keeps the pool's history usable."""
    pd = yaml.safe_load(LOCAL_PD.read_text())
    uni = _raw()
    for key in ("model", "dtype", "cache"):
        assert pd[key] == uni[key]
    assert copy.deepcopy(pd["pool"]) == uni["pool"]


def test_kvserve_check_describes_the_unified_instance() -> None:
    import io
    import os

    from kvserve.launcher import check

    out = io.StringIO()
    assert check(LOCAL, out) == 0
    text = out.getvalue()
    assert "unified  unified-0 on local http://127.0.0.1:8100  devices cpu" in text
    assert "kv cache unified-0: bfloat16, 23040 bytes per token" in text
    cpus = sorted(os.sched_getaffinity(0))
    assert f"cpus     local: unified-0 process 0: CPUs {cpus}, {len(cpus)} torch thread(s)" in text

"""Process startup shared by worker entry points: config -> engine, logging, serving."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from engine.config import EngineConfig
from engine.faults import EngineFaults
from engine.llm_engine import LLMEngine
from enginehost.cpu_plan import CpuSlot, setup_cpu_engine
from modelinfo.info import ModelInfo, load_model_info
from protocol.cluster import (
    ClusterConfig,
    DecodeConfig,
    EngineFaultsConfig,
    NodeConfig,
    PrefillConfig,
    UnifiedConfig,
    load_cluster,
)
from protocol.cluster_model_checks import check_model_layouts
from protocol.config_errors import ConfigError
from protocol.internal_auth import SECRET_ENV, secret_from_env, secret_problem


@dataclass(frozen=True)
class InstanceContext:
    """What a worker entry point starts from: its section of cluster.yaml and the model."""

    config_path: str
    cluster: ClusterConfig
    instance: PrefillConfig | DecodeConfig | UnifiedConfig
    node: NodeConfig
    info: ModelInfo
    secret: str
    """The cluster secret (protocol/internal_auth.py): internal calls to this worker must
    carry it, the worker's own calls carry it, landing capabilities are keyed by it."""


def load_instance(role: str, argv: list[str] | None) -> InstanceContext:
    """`python -m {role}_worker -c FILE --name NAME`: parse, load the instance's section,
    set up logging, load the model's metadata and check the instance's layout against it.
    A layout that does not fit the model exits with status 2 and the key that is wrong;
    so does a missing cluster secret (a worker never serves unauthenticated)."""
    ap = argparse.ArgumentParser(prog=f"python -m {role}_worker")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    cluster = load_cluster(args.config)
    instance: PrefillConfig | DecodeConfig | UnifiedConfig
    if role == "prefill":
        instance = cluster.prefill_instance(args.name)
    elif role == "unified":
        instance = cluster.unified_instance(args.name)
    else:
        instance = cluster.decode_instance(args.name)
    setup_logging(cluster.log_level, instance.name)
    secret = secret_from_env()
    problem = "it is not set" if secret is None else secret_problem(secret)
    if problem is not None:
        print(
            f"python -m {role}_worker: {SECRET_ENV} is unusable ({problem}): a worker only "
            "serves with the cluster secret; start it with `kvserve up`, which sets it",
            file=sys.stderr,
        )
        raise SystemExit(2)
    assert secret is not None
    info = load_model_info(cluster.model)
    try:
        check_model_layouts(cluster, info.config, only=instance.name)
    except ConfigError as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return InstanceContext(
        args.config, cluster, instance, cluster.node(instance.node), info, secret
    )


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: health checks and notices would flood the log
    logging.getLogger("httpx").setLevel(logging.WARNING)


def torch_device(device: object) -> str:
    """A cluster.yaml device entry ("cpu" or a GPU index) as a torch device string."""
    return "cpu" if str(device) == "cpu" else f"cuda:{device}"


def set_cpu_threads(
    cluster: ClusterConfig, inst: PrefillConfig | DecodeConfig | UnifiedConfig, index: int = 0
) -> CpuSlot | None:
    """Pin and size the thread pools of stage / rank `index` of `inst` when it runs on
    the CPU (enginehost/cpu_plan.py) and return its slot; a GPU process keeps torch's
    defaults (None)."""
    if str(inst.devices[index]) == "cpu":
        return setup_cpu_engine(cluster, inst.node, inst.name, index)
    return None


def engine_config(
    cluster: ClusterConfig,
    *,
    device: object,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_batched_tokens: int = 2048,
    faults: EngineFaultsConfig | None = None,
    admission: str = "chunk",
) -> EngineConfig:
    """The EngineConfig of one engine process (or one rank / stage of an instance);
    `faults`: the instance's test-only engine_faults; `admission`: its admission rule
    (a prefill instance's is cache.prefill_admission)."""
    name = torch_device(device)
    backend = cluster.attention_backend
    if backend == "auto":
        backend = "cpu" if name == "cpu" else "flex"  # each measured fastest on its device
    return EngineConfig(
        attention_backend=backend,
        block_size=cluster.cache.block_size,
        chunk_size=cluster.cache.chunk_size,
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        prefill_order=cluster.cache.prefill_order,
        prefill_bound_steps=cluster.cache.prefill_bound_steps,
        admission=admission,
        dtype=cluster.dtype,
        kv_cache_dtype=cluster.kv_cache_dtype,
        device=name,
        cache_dir=cluster.cache.weights_cache_dir,
        faults=None
        if faults is None
        else EngineFaults(
            fail_seed=faults.fail_seed,
            place=faults.place,
            stage=faults.stage,
            rank=faults.rank,
            layer=faults.layer,
            hang_s=faults.hang_s,
        ),
    )


def build_engine(
    cluster: ClusterConfig,
    *,
    device: object,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_batched_tokens: int = 2048,
) -> LLMEngine:
    config = engine_config(
        cluster,
        device=device,
        kv_cache_bytes=kv_cache_bytes,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
    )
    return LLMEngine.from_spec(cluster.model, config)


def serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's handlers stop it gracefully)."""
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level if log_level != "debug" else "info",
        access_log=False,
        timeout_graceful_shutdown=3,
    )

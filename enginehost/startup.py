"""Process startup shared by worker entry points: config -> engine, logging, serving."""

from __future__ import annotations

import logging
import os

import torch
import uvicorn
from fastapi import FastAPI

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.cluster import ClusterConfig


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def torch_device(device: object) -> str:
    """A cluster.yaml device entry ("cpu" or a GPU index) as a torch device string."""
    return "cpu" if str(device) == "cpu" else f"cuda:{device}"


def cpu_threads_per_engine(cluster: ClusterConfig, node: str) -> int:
    """Split this host's cores evenly among the engine processes the cluster puts on it.

    Every torch CPU engine defaults to one thread per core; several of them on one host
    oversubscribe the cores, and OpenMP's spinning barriers then make each step many
    times slower than with fewer threads."""
    n = sum(i.pipeline_parallel for i in cluster.prefill if i.node == node)
    n += sum(i.tensor_parallel for i in cluster.decode if i.node == node)
    return max(1, (os.cpu_count() or 1) // max(1, n))


def engine_config(
    cluster: ClusterConfig,
    *,
    device: object,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_batched_tokens: int = 2048,
) -> EngineConfig:
    """The EngineConfig of one engine process (or one rank / stage of an instance)."""
    return EngineConfig(
        block_size=cluster.cache.block_size,
        chunk_size=cluster.cache.chunk_size,
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        dtype=cluster.dtype,
        device=torch_device(device),
        cache_dir=cluster.cache.weights_cache_dir,
    )


def set_cpu_threads(device: object, cpu_threads: int | None) -> None:
    if cpu_threads is not None and str(device) == "cpu":
        torch.set_num_threads(cpu_threads)


def build_engine(
    cluster: ClusterConfig,
    *,
    device: object,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_batched_tokens: int = 2048,
    cpu_threads: int | None = None,
) -> LLMEngine:
    set_cpu_threads(device, cpu_threads)
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

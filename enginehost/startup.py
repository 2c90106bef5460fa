"""Process startup shared by worker entry points: config -> engine, logging, serving."""

from __future__ import annotations

import logging

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


def build_engine(
    cluster: ClusterConfig,
    *,
    device: object,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_batched_tokens: int = 2048,
) -> LLMEngine:
    config = EngineConfig(
        block_size=cluster.cache.block_size,
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        dtype=cluster.dtype,
        device=torch_device(device),
        cache_dir=cluster.cache.weights_cache_dir,
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

"""EngineConfig: one frozen, validated configuration for an engine instance."""

from __future__ import annotations

import msgspec

from engine.admission import ADMISSIONS
from engine.faults import EngineFaults
from engine.prefill_order import PrefillOrder
from protocol.kv_layout import KV_CACHE_DTYPES

_DTYPES = ("float32", "float16", "bfloat16")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one engine (one process holding a whole model or a stage of it)."""

    block_size: int = 16
    """Tokens per KV block: the unit of paging and of the prefix cache."""
    chunk_size: int = 256
    """Tokens per pool chunk (cluster.yaml cache.chunk_size); part of the KV namespace."""
    kv_cache_bytes: int = 512 * 1024**2
    """Memory for the paged KV cache; ignored when num_blocks is set."""
    num_blocks: int | None = None
    """Exact number of KV blocks (tests and small budgets)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, prefill chunks and decodes together."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    prefill_order: str = "shortest"
    """Which prefills get a step's budget first (engine/prefill_order.py): "shortest"
    (fewest tokens left first, within a bound) or "fcfs" (admission order)."""
    prefill_bound_steps: int = 64
    """shortest: steps after its arrival from which a request goes first."""
    admission: str = "chunk"
    """When a waiting request may start (engine/admission.py): "chunk" (the blocks of the
    chunk it is given are free) or "whole_prompt" (its whole prompt fits beside what the
    running requests still lack: no preemption before a prompt is in; a prefill
    instance's rule, cluster.yaml cache.prefill_admission)."""
    max_model_len: int | None = None
    """Context limit (prompt + output); defaults to the model's max_position_embeddings."""
    dtype: str = "float32"
    """Weights and activations element type (and the KV's, with kv_cache_dtype "auto")."""
    kv_cache_dtype: str = "auto"
    """KV cache format: "auto" (dtype) or "fp8_e4m3" (float8 e4m3 with a float32 scale per
    token and head; about half the bytes of bfloat16 KV: docs/kv_cache.md)."""
    device: str = "cpu"
    attention_backend: str = "torch"
    """"torch" (the reference; CPU and CUDA), "torch_lse" (reference with LSE, DCP),
    "cpu" (decode rows read the paged cache in place with a C kernel; CPU only:
    engine/attention/cpu_paged.py) or "flex" (FlexAttention kernels reading the paged
    cache in place; CUDA only, block_size >= 16)."""
    cuda_graphs: bool = True
    """Capture pure-decode steps in CUDA graphs at start-up, one per batch-size bucket up to
    max_num_seqs (only on CUDA with a graph-safe backend: "flex"). False runs every step
    eagerly (same tokens, more launch overhead)."""
    compile_layers: bool = True
    """With CUDA graphs: fuse each decoder layer's element-wise glue (RMSNorm, RoPE, residual
    adds, SwiGLU) with torch.compile before capture (engine/models/layer_ops.py); falls
    back to the eager ops if compiling fails. No effect without graphs (CPU)."""
    decode_ahead: bool = True
    """With CUDA graphs: launch the next pure-decode step with this step's sampled tokens
    still on the device, before the host has read them, so the host's work between steps
    runs while the GPU computes (engine/decode_ahead.py). Same tokens either way."""
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    """Where converted weights are cached; None means ~/.cache/kvserve."""
    faults: EngineFaults | None = None
    """Injected per-request faults, for tests only (engine/faults.py); None: off."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size must be a positive multiple of block_size {self.block_size}, "
                f"got {self.chunk_size}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        PrefillOrder(kind=self.prefill_order, bound_steps=self.prefill_bound_steps)
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be >= 1")

"""The "cpu" attention backend: decode and prefill rows read the paged KV cache in place
with small C kernels (engine/attention/cpu_kernel.py, cpu_decode.c, cpu_prefill.c);
everything else is the "torch" reference it extends.

Why: the reference gathers each sequence's whole KV into a copy per layer per step and
runs SDPA over it, whose CPU kernel is slow for a single query row in bfloat16 and runs
~75 GFLOP/s for a chunk of rows. The kernels walk the block table instead, read each K
and V row once for all query heads of its KV head (GQA), and accumulate in float32: at
6K tokens of context a SmolLM2-135M layer's decode attention goes from ~0.75 to ~0.3 ms
on one core, and 256 new tokens behind it from ~49 to ~26 ms (docs/benchmarks.md, "CPU
step costs"); no per-step work grows with the context except the kernels' own reads.

One step's flat batch splits by query length:

    decode rows (q_len == 1)  -> the decode kernel, all such sequences in one call
    prefill rows (q_len > 1)  -> the prefill kernel, all such sequences in one call:
                                 each chunk behind its cached prefix, lower-right causal

Falls back to the reference whole (said once in the log) where the kernels do not
apply: fp8 KV rows, MLA latents, a non-CPU device, a machine without a C compiler, more
than 256 query heads or head dims.
Not an LSE backend: decode context parallelism keeps using "torch_lse".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import cpu_kernel
from engine.attention.base import AttentionMetadata, register_backend
from engine.attention.torch_ref import TorchAttentionBackend

log = logging.getLogger(__name__)

_PLAN_KEY = "cpu_paged"
"""meta.backend_state key of this backend's plan (the reference's fallback plan lives
under the backend's name)."""


@dataclass
class _Plan:
    """Per-step plan shared by every layer."""

    decode_rows: torch.Tensor | None  # [Bd] int64 query rows; None = rows 0..Bd-1
    num_decode: int
    tables: torch.Tensor | None  # [Bd, >= blocks] int32, unit column stride
    lens: torch.Tensor | None  # [Bd] int32 KV lengths
    max_len: int
    prefills: torch.Tensor | None  # [Bp, 4] int32: first query row, q_len, seq_len, table row
    all_tables: torch.Tensor  # [B, >= blocks] int32, unit column stride: prefill's rows


def _build_plan(meta: AttentionMetadata) -> _Plan:
    q_lens, seq_lens, starts = meta.query_lens(), meta.seq_lens, meta.query_start_loc
    decode = [b for b, q in enumerate(q_lens) if q == 1]
    all_tables = meta.block_tables
    if all_tables.dtype != torch.int32 or all_tables.stride(-1) != 1:
        all_tables = all_tables.to(torch.int32).contiguous()
    prefill = [[starts[b], q, seq_lens[b], b] for b, q in enumerate(q_lens) if q > 1]
    prefills = torch.tensor(prefill, dtype=torch.int32) if prefill else None
    plan = _Plan(None, len(decode), None, None, 0, prefills, all_tables)
    if not decode:
        return plan
    tables = all_tables
    if len(decode) == len(seq_lens):
        lens = meta.seq_lens_tensor
        if lens is None or lens.dtype != torch.int32:
            lens = torch.tensor(seq_lens, dtype=torch.int32)
    else:
        idx = torch.tensor(decode, dtype=torch.int64)
        tables = tables.index_select(0, idx)
        lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.int32)
    plan.tables, plan.lens = tables, lens.contiguous()
    plan.max_len = max(seq_lens[b] for b in decode)
    rows = [starts[b] for b in decode]
    if rows != list(range(len(decode))):
        plan.decode_rows = torch.tensor(rows, dtype=torch.int64)
    return plan


@register_backend
class CpuPagedAttentionBackend(TorchAttentionBackend):
    """The reference with decode and prefill rows on the in-place CPU kernels. Building it
    builds (or finds in the cache) the kernel library, so the compile is paid at engine
    start-up."""

    name = "cpu"

    def __init__(self) -> None:
        self.kernel = cpu_kernel.available()
        self._said_fallback = False

    def _fallback(self, why: str) -> None:
        if not self._said_fallback:
            log.info("cpu attention backend: %s; using the torch reference path", why)
            self._said_fallback = True

    def _attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        value_dim: int | None,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        if value_dim is not None or not self.kernel or q.device.type != "cpu":
            self._fallback("MLA, a non-CPU device or no kernel")
            return super()._attend(q, k, v, kv_cache, meta, scale, value_dim)
        if kv_cache.dtype not in (torch.bfloat16, torch.float32):
            self._fallback(f"KV cache rows of {kv_cache.dtype} (fp8)")
            return super()._attend(q, k, v, kv_cache, meta, scale, value_dim)
        if q.shape[1] > cpu_kernel.MAX_HEADS or q.shape[2] > cpu_kernel.MAX_HEAD_DIM:
            self._fallback(f"{q.shape[1]} query heads of {q.shape[2]} dims")
            return super()._attend(q, k, v, kv_cache, meta, scale, value_dim)
        plan = meta.backend_state.get(_PLAN_KEY)
        if plan is None:
            plan = _build_plan(meta)
            meta.backend_state[_PLAN_KEY] = plan
        num_decode, rows = plan.num_decode, plan.decode_rows
        qf = q.to(torch.float32).contiguous()
        if num_decode and plan.prefills is None and rows is None:
            return self._decode_rows(qf, kv_cache, plan, scale).to(q.dtype)  # no scatter
        out = torch.empty(qf.shape, dtype=torch.float32)
        if num_decode:
            q_dec = qf[:num_decode] if rows is None else qf.index_select(0, rows)
            o_dec = self._decode_rows(q_dec, kv_cache, plan, scale)
            if rows is None:
                out[:num_decode] = o_dec
            else:
                out.index_copy_(0, rows, o_dec)
        if plan.prefills is not None:
            lse = torch.empty(qf.shape[:2], dtype=torch.float32)
            cpu_kernel.prefill(qf, kv_cache, plan.all_tables, plan.prefills, scale, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def _decode_rows(
        q: torch.Tensor,  # [Bd, Hq, D] float32 contiguous
        kv_cache: torch.Tensor,
        plan: _Plan,
        scale: float,
    ) -> torch.Tensor:  # [Bd, Hq, D] float32
        assert plan.tables is not None and plan.lens is not None
        out, _ = cpu_kernel.decode(q, kv_cache, plan.tables, plan.lens, plan.max_len, scale)
        return out

"""The "cpu" attention backend: decode rows read the paged KV cache in place with a small
C kernel (engine/attention/cpu_kernel.py, cpu_decode.c); everything else is the "torch"
reference it extends.

Why: the reference gathers each decoding sequence's whole KV into a padded copy per layer
per step and runs SDPA over it, whose CPU kernel is slow for a single query row in
bfloat16. The kernel walks the block table instead, reads each K and V row once for all
query heads of its KV head (GQA), and accumulates in float32: at 6K tokens of context a
SmolLM2-135M layer's decode attention goes from ~0.75 to ~0.3 ms on one core
(docs/benchmarks.md, "CPU step costs"), and no per-step work grows with the context
except the kernel's own reads.

One step's flat batch splits as in the reference:

    decode rows (q_len == 1)  -> the kernel, all sequences in one call
    prefill rows (q_len > 1)  -> the reference per sequence (gather + SDPA with a causal
                                 mask shifted by the cached prefix: one copy of the
                                 prefix per chunk, shared by all its new tokens)

Falls back to the reference whole (said once in the log) where the kernel does not
apply: fp8 KV rows, MLA latents, a non-CPU device, a machine without a C compiler.
Not an LSE backend: decode context parallelism keeps using "torch_lse".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import cpu_kernel
from engine.attention.base import AttentionMetadata, register_backend
from engine.attention.torch_ref import TorchAttentionBackend, _PrefillSeq, prefill_seqs

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
    prefills: list[_PrefillSeq]


def _build_plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    q_lens, seq_lens, starts = meta.query_lens(), meta.seq_lens, meta.query_start_loc
    decode = [b for b, q in enumerate(q_lens) if q == 1]
    prefills = prefill_seqs(meta, block_size, meta.block_tables.device)
    plan = _Plan(None, len(decode), None, None, 0, prefills)
    if not decode:
        return plan
    tables = meta.block_tables
    if len(decode) == len(seq_lens):
        lens = meta.seq_lens_tensor
        if lens is None or lens.dtype != torch.int32:
            lens = torch.tensor(seq_lens, dtype=torch.int32)
    else:
        idx = torch.tensor(decode, dtype=torch.int64)
        tables = tables.index_select(0, idx)
        lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.int32)
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    plan.tables, plan.lens = tables, lens.contiguous()
    plan.max_len = max(seq_lens[b] for b in decode)
    rows = [starts[b] for b in decode]
    if rows != list(range(len(decode))):
        plan.decode_rows = torch.tensor(rows, dtype=torch.int64)
    return plan


@register_backend
class CpuPagedAttentionBackend(TorchAttentionBackend):
    """The reference with decode rows on the in-place CPU kernel. Building it builds (or
    finds in the cache) the kernel library, so the compile is paid at engine start-up."""

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
        if q.shape[1] > cpu_kernel.MAX_HEADS:
            self._fallback(f"{q.shape[1]} query heads")
            return super()._attend(q, k, v, kv_cache, meta, scale, value_dim)
        plan = meta.backend_state.get(_PLAN_KEY)
        if plan is None:
            plan = _build_plan(meta, kv_cache.shape[2])
            meta.backend_state[_PLAN_KEY] = plan
        num_decode, rows = plan.num_decode, plan.decode_rows
        if num_decode and not plan.prefills and rows is None:
            return self._decode_rows(q, kv_cache, plan, scale)  # pure decode step: no scatter
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        if num_decode:
            q_dec = q[:num_decode] if rows is None else q.index_select(0, rows)
            o_dec = self._decode_rows(q_dec, kv_cache, plan, scale)
            if rows is None:
                out[:num_decode] = o_dec
            else:
                out.index_copy_(0, rows, o_dec)
        for seq in plan.prefills:
            out[seq.q_start : seq.q_end] = self._prefill(q, k, v, kv_cache, seq, scale)
        return out

    @staticmethod
    def _decode_rows(
        q: torch.Tensor,  # [Bd, Hq, D]
        kv_cache: torch.Tensor,
        plan: _Plan,
        scale: float,
    ) -> torch.Tensor:  # [Bd, Hq, D]
        assert plan.tables is not None and plan.lens is not None
        qf = q.to(torch.float32).contiguous()
        out, _ = cpu_kernel.decode(qf, kv_cache, plan.tables, plan.lens, plan.max_len, scale)
        return out.to(q.dtype)

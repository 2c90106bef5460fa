"""ModelRunner: turns a scheduled step into tensors, runs the model, returns logits.

For a step with requests r0 (3 new tokens from position 5) and r1 (1 decode token at 9):

    input_ids   = [t5 t6 t7 | t9]          positions    = [5 6 7 | 9]
    slot_mapping= [s(r0,5) s(r0,6) s(r0,7) | s(r1,9)]   s(r,p) = table_r[p//bs]*bs + p%bs
    query_start_loc = [0, 3, 4]            seq_lens     = [8, 10]

Only requests that sample this step contribute a row of logits (their last token).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledRequest
from protocol.kv_layout import KVLayout


class ModelExecutor(Protocol):
    """What LLMEngine needs of whatever runs its model: this class in one process, or the
    driver of a parallel instance (engine/parallel/). Engine thread only."""

    kv_caches: list[torch.Tensor]
    """The paged KV this process holds (decode fills it with handed-off KV)."""
    num_blocks: int
    """Blocks of every cache: the scheduler's block pool has exactly this many."""
    layer_split: tuple[int, ...]
    """Layers per pipeline stage (part of the KV namespace); (num_layers,) without PP."""

    def execute(self, scheduled: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor | None:
        """Run one step; float32 logits of the sampling requests' last tokens, or None."""
        ...

    def close(self) -> None:
        """Release processes and buffers (idempotent)."""
        ...


class ModelRunner:
    """Owns the model, the paged KV tensors of its layers, and step input preparation."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layout: KVLayout,
        num_blocks: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.backend = backend
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # kv_caches[i]: [2, num_blocks, block_size, Hkv, D], layer i of this model.
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.num_blocks = num_blocks
        self.layer_split: tuple[int, ...] = (layout.num_layers,)

    def close(self) -> None:
        pass

    def prepare(
        self, scheduled: list[ScheduledRequest], kv: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata and the rows to sample."""
        bs = self.layout.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for s in scheduled:
            r = s.request
            start = r.num_computed_tokens
            end = start + s.num_new_tokens
            table = kv.block_table(r.request_id)
            ids.extend(r.all_token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(list(table))
            if s.samples:
                sample_rows.append(qsl[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor | None:
        """Run one step; return float32 logits [num_sampling_requests, V] (None if none
        sample)."""
        input_ids, positions, meta, rows = self.prepare(scheduled, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return None
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        return logits.float()

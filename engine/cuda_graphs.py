"""DecodeGraphs: CUDA graphs of pure-decode steps, one per batch-size bucket.

A decode step of an 8B model launches ~600 small kernels; launched one by one from
Python they take longer than the ~3 ms the step's weight reads need. Each bucket's graph
is captured once at start-up over static input buffers and replayed every step:

    step with n decode rows -> bucket B = smallest captured size >= n
    static buffers [:n]  <- this step's ids, positions, slots, KV lengths, table rows
    static buffers [n:B] <- padding: slot = the scratch block, KV length 1
    replay -> logits [B, V] (rows n.. are discarded)

Padding rows write their K/V into a scratch block the scheduler never hands out, so they
touch no live sequence. Only backends with `graph_safe_decode` are captured (the decode
step reads device tensors only). Mixed and prefill steps, and decode batches larger than
the largest bucket, run eagerly.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flex import padded_batch
from engine.models.llama import LlamaForCausalLM


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes the flex backend pads decode rows to (1, 2, 4, 8, then multiples
    of 8 to 32, of 16 to 128, of 32 beyond), up to the first >= max_batch: few graphs,
    at most ~12% padding past 8 rows, and no second padding inside the backend."""
    return sorted({padded_batch(n) for n in range(1, max_batch + 1)})


class DecodeGraphs:
    """Owns the static buffers and graphs; engine thread only."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        device: torch.device,
        sizes: list[int] | None = None,
    ) -> None:
        """`sizes` overrides the buckets (each must be a padded_batch size)."""
        self.model, self.kv_caches = model, kv_caches
        self.block_size = block_size
        self.sizes = sorted(sizes) if sizes else bucket_sizes(max_batch)
        assert all(padded_batch(s) == s for s in self.sizes), self.sizes
        self.max_batch = self.sizes[-1]
        self.width = max_blocks_per_seq
        self.scratch_slot = scratch_block * block_size
        n, dev = self.max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,  # structure only: graph-safe backends read seq_lens_tensor
            block_tables=self.tables[:size],
            seq_lens_tensor=self.seq_lens[:size],
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Compile (warm-up runs) and capture every bucket, largest first, in one memory
        pool. The warm-up writes only the scratch block."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int, width: int) -> int | None:
        """The graph for a decode step of num_seqs rows whose tables need `width` blocks;
        None when it must run eagerly."""
        if num_seqs > self.max_batch or width > self.width or not self._graphs:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    @torch.inference_mode()
    def run(
        self,
        size: int,
        inputs: torch.Tensor,  # [4, n] int64 on the device: ids, positions, slots, lens
        table_rows: torch.Tensor,  # [n, w] int32 block ids
    ) -> torch.Tensor:  # [n, V] float32 logits
        n, width = table_rows.shape
        self.input_ids[:n].copy_(inputs[0])
        self.positions[:n].copy_(inputs[1])
        self.slots[:n].copy_(inputs[2])
        self.seq_lens[:n].copy_(inputs[3])
        self.tables[:n, :width].copy_(table_rows)
        if n < size:  # rows left by a larger step must not write into live blocks
            self.slots[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
        self._graphs[size].replay()
        return self._logits[size][:n]

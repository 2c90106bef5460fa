"""DecodeGraphs: CUDA graphs of pure-decode steps, one per batch-size bucket.

A decode step of an 8B model launches ~400 small kernels; launched one by one from
Python they take longer than the ~3 ms the step's weight reads need. Each bucket's graph
is captured once at start-up over one static input buffer and replayed every step:

    step with n decode rows -> bucket B = smallest captured size >= n
    pinned host [5, B] int64  = ids | positions | slots | KV lengths | table rows
                 (columns n..B: padding: slot = the scratch block, KV length 1, row 0)
    ONE H2D copy into the bucket's static buffer, then replay:
        block tables = DeviceBlockTables.table[table rows]   (gathered inside the graph)
        model forward -> logits [B, V] (rows n.. are discarded; float32 at B = 1, the
                         model's dtype above: the sampler casts where it needs float32)

Padding rows write their K/V into a scratch block the scheduler never hands out, so they
touch no live sequence, and read (never write) whatever blocks table row 0 names. The
graphs read the block tables' device tensor in place: if DeviceBlockTables reallocates it
(more rows or wider tables than it was sized for), steps run eagerly. Only backends with
`graph_safe_decode` are captured (the decode step reads device tensors only). Mixed and
prefill steps, and decode batches larger than the largest bucket, run eagerly. Buckets in
layer_ops.TUNE_ROWS are compiled with max-autotune by their warm-up step, before capture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flex import padded_batch
from engine.device_tables import DeviceBlockTables
from engine.models import layer_ops
from engine.models.llama import LlamaForCausalLM

CPU_EMULATION = False
"""Tests set this: on a CPU device the graphs are emulated (a replay runs the captured
forward eagerly over the same static buffers), so the decode input path is testable
without CUDA."""


FLOAT32_LOGITS = False
"""True: every bucket's graph casts its logits to float32 (what a step of more than one row
did before they stayed 16-bit; benchmarks/gpu_engine.py compares the two)."""


class _EagerReplay:
    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


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
        tables: DeviceBlockTables,
        *,
        block_size: int,
        max_batch: int,
        scratch_block: int,
        device: torch.device,
        sizes: list[int] | None = None,
    ) -> None:
        """`sizes` overrides the buckets (each must be a padded_batch size). `tables` is
        read in place by every replay: its width bounds the graphs' tables."""
        self.model, self.kv_caches = model, kv_caches
        self.block_tables = tables
        self.source = tables.table
        """The table tensor the graphs gather from (replays need it still current)."""
        self.block_size = block_size
        self.sizes = sorted(sizes) if sizes else bucket_sizes(max_batch)
        assert all(padded_batch(s) == s for s in self.sizes), self.sizes
        self.max_batch = self.sizes[-1]
        self.width = tables.table.shape[1]
        self.scratch_slot = scratch_block * block_size
        n = self.max_batch
        # Bucket B reads packed[: 5 * B] as [5, B]: ids, positions, slots, KV lengths,
        # table rows (int64).
        self.packed = torch.zeros(5 * n, dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        self._host = [torch.zeros(5 * n, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]  # host writes through numpy: ~us
        self._padding = np.array([0, 0, self.scratch_slot, 1, 0], dtype=np.int64)[:, None]
        self._host_free: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.replays = 0
        """Steps run through the graphs (tests check that decode steps do)."""
        self._graphs: dict[int, torch.cuda.CUDAGraph | _EagerReplay] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _step(self, size: int) -> torch.Tensor:
        return self.packed[: 5 * size].view(5, size)

    def _forward(self, size: int, as_eager: bool = False) -> torch.Tensor:
        """The bucket's forward; `as_eager`: as a step of `size` tokens that is not a
        graph's runs it (RoPE in the glue, float32 logits: glue variants of their own),
        for the warm-up to compile before serving what prefill and mixed steps run."""
        step = self._step(size)
        meta = AttentionMetadata(
            slot_mapping=step[2],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,  # structure only: graph-safe backends read seq_lens_tensor
            block_tables=self.source.index_select(0, step[4]),
            seq_lens_tensor=step[3].to(torch.int32),
            rope_in_write=not as_eager,
        )
        hidden = self.model(step[0], step[1], self.kv_caches, meta)
        # Over one row the float32 cast is fused into the lm_head's GEMV (layer_ops.py);
        # over more it would be a kernel of its own (23 us at 128 rows of an 8B model's
        # 128K vocabulary), and the sampler needs no float32 for greedy rows.
        return self.model.compute_logits(hidden, float32=size == 1 or FLOAT32_LOGITS or as_eager)

    @torch.inference_mode()
    def capture(self) -> None:
        """Compile (warm-up runs) and capture every bucket, largest first, in one memory
        pool. The warm-up writes only the scratch block."""
        if not self.cuda:
            assert CPU_EMULATION, "decode graphs need CUDA"
            for size in self.sizes:
                self._fill_padding(self._step(size), 0)
                out = self._forward(size)
                self._logits[size] = out
                self._graphs[size] = _EagerReplay(functools.partial(self._forward, size), out)
            return
        for size in self.sizes:
            layer_ops.tune(size)  # compiled (and tuned) by the warm-up below, if listed
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._fill_padding(self._step(size), 0)  # the buckets' views overlap
                self._forward(size)
                if size > 1:
                    self._forward(size, as_eager=True)
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
        if (
            num_seqs > self.max_batch
            or width > self.width
            or not self._graphs
            or self.block_tables.table is not self.source
        ):
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def _fill_padding(self, step: torch.Tensor, n: int) -> None:
        for row, value in enumerate(self._padding[:, 0].tolist()):
            step[row, n:] = value

    @torch.inference_mode()
    def run(
        self,
        size: int,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        rows: list[int],
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [n, V] logits (float32 at size 1), valid until the next run
        """One decode step of n = len(ids) rows in bucket `size`: the step's inputs go up
        in one copy from pinned memory (two buffers alternate; a buffer is rewritten only
        once its previous copy is done), then the graph replays. `device_ids` [n] int64
        (a device tensor) replaces `ids`: a step launched before its input tokens reached
        the host (engine/decode_ahead.py)."""
        n = len(ids)
        turn = self._turn
        self._turn ^= 1
        free = self._host_free[turn]
        if free is not None:
            free.synchronize()
        host = self._host[turn][: 5 * size]
        step = self._host_np[turn][: 5 * size].reshape(5, size)
        step[:, :n] = (ids, positions, slots, seq_lens, rows)
        if n < size:
            step[:, n:] = self._padding
        self.packed[: 5 * size].copy_(host, non_blocking=True)
        if device_ids is not None:
            self.packed[:n].copy_(device_ids)  # row 0 of the [5, size] view: the ids
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self._host_free[turn] = done
        self._graphs[size].replay()
        self.replays += 1
        return self._logits[size][:n]

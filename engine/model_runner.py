"""ModelRunner: turns a scheduled step into tensors, runs the model, returns logits.

For a step with requests r0 (3 new tokens from position 5) and r1 (1 decode token at 9):

    input_ids   = [t5 t6 t7 | t9]          positions    = [5 6 7 | 9]
    slot_mapping= [s(r0,5) s(r0,6) s(r0,7) | s(r1,9)]   s(r,p) = table_r[p//bs]*bs + p%bs
    query_start_loc = [0, 3, 4]            seq_lens     = [8, 10]

Only requests that sample this step contribute a row of logits (their last token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from engine import cuda_graphs as cuda_graphs_module
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.decode_ahead import DecodeAhead
from engine.device_tables import DeviceBlockTables
from engine.kv_cache_manager import KVCacheManager
from engine.models.layer_ops import EAGER, set_layer_ops
from engine.models.layer_ops import compiled as compiled_layer_ops
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledRequest
from protocol.kv_layout import KVLayout

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 4096
"""The warm-up's first step (tokens; at most the step budget): see ModelRunner._warm_up."""


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
        """Run one step; logits of the sampling requests' last tokens (float32, or the
        model's 16-bit dtype from a decode graph of more than one row), or None."""
        ...

    def close(self) -> None:
        """Release processes and buffers (idempotent)."""
        ...


class ModelRunner:
    """Owns the model, the paged KV tensors of its layers, the device block tables, the
    decode CUDA graphs (CUDA, a graph-safe backend, `cuda_graphs`; with `compile_layers`
    the layers' element-wise glue is fused by torch.compile first, engine/models/
    layer_ops.py), and step input preparation.

    Host work per step is O(new tokens + batch): block tables live on the device and take
    only their new entries (DeviceBlockTables), and the step's ids, positions, slots and
    KV lengths go up in one copy."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layout: KVLayout,
        num_blocks: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
        cuda_graphs: bool = False,
        max_batch: int = 64,
        max_model_len: int | None = None,
        graph_sizes: list[int] | None = None,
        compile_layers: bool = True,
        warm_up_tokens: int = 0,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.backend = backend
        # fp8 rows decode through the reference path (engine/attention/flex.py): no graphs
        use_graphs = (
            cuda_graphs
            and (device.type == "cuda" or cuda_graphs_module.CPU_EMULATION)
            and backend.graph_safe_decode
            and layout.cache_dtype == "auto"
        )
        # One extra block past those the scheduler hands out: CUDA-graph padding rows
        # write their K/V there.
        shape = layout.cache_shape(num_blocks + use_graphs)
        store = dtype if layout.cache_dtype == "auto" else torch.uint8
        # kv_caches[i]: [P, num_blocks(+1), block_size, Hkv, W], layer i of this model
        # (P = 2 for K and V, 1 for an MLA latent; W = D, or D + 4 for fp8 rows with their
        # scale; protocol/kv_layout.py).
        self.kv_caches = [
            torch.zeros(shape, dtype=store, device=device) for _ in range(layout.num_layers)
        ]
        self.num_blocks = num_blocks
        self.layer_split: tuple[int, ...] = (layout.num_layers,)
        self.graphs: DecodeGraphs | None = None
        self.max_len = max_model_len or model.config.max_position_embeddings
        self._ahead: DecodeAhead | None = None
        self.ahead_launched = 0
        self.ahead_taken = 0
        """Decode steps launched ahead, and how many of them a step used (tests, metrics)."""
        if not use_graphs:
            self.tables = DeviceBlockTables(device)
        else:
            # Sized once for every step the scheduler can form (max_batch requests, the
            # longest sequence): the graphs read this tensor in place.
            max_len = self.max_len
            width = -(-max_len // layout.block_size)
            self.tables = DeviceBlockTables(device, rows=max_batch + 1, width=width)
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                self.tables,
                block_size=layout.block_size,
                max_batch=max_batch,
                scratch_block=num_blocks,
                device=device,
                sizes=graph_sizes,
            )
            if compile_layers:
                set_layer_ops(model, compiled_layer_ops())
            try:
                self.graphs.capture()
            except Exception:  # the fused ops failed to compile: the eager ones always work
                if not compile_layers:
                    raise
                log.exception("compiling the decoder layers failed; running them eagerly")
                set_layer_ops(model, EAGER)
                self.graphs.capture()
            if warm_up_tokens and device.type == "cuda":
                self._warm_up(warm_up_tokens)

    @torch.inference_mode()
    def _warm_up(self, max_tokens: int) -> None:
        """Run two prefill-shaped steps before serving, so that the first requests do not
        pay for first use. The decode graphs' capture compiles the fused layer glue for
        their row counts only (up to 64 rows); a step of more tokens runs the general
        compiled glue, which torch.compile builds for the first such step's size and again
        for a symbolic size at the second (seconds each on an 8B model: the serving run's
        first two prefill steps took 4.6 and 1.9 s, docs/benchmarks.md "Ninth run"). Two
        steps of different sizes here: `first` new tokens, then half as many behind them
        (the attention's paths over a cached prefix and their kernels' first launches
        too). They write KV into blocks no request holds yet; nothing of them is kept."""
        bs = self.layout.block_size
        first = min(max_tokens, WARM_UP_TOKENS, self.num_blocks * bs * 2 // 3)
        second = first // 2
        if second <= 64:  # nothing the graphs' capture has not compiled
            return
        t0 = time.perf_counter()
        row = _WarmUpRow([1] * (first + second))
        tables = _WarmUpTables(list(range(-(-(first + second) // bs))))
        try:
            for n in (first, second):
                self.execute([ScheduledRequest(cast(Any, row), n)], cast(Any, tables))
                row.num_computed_tokens += n
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # a step that fails here fails the first requests the same way
            log.exception("the prefill warm-up failed; the first requests pay for first use")
        finally:
            self.tables.update([])  # the row's device table row back to the free list
        log.info(
            "prefill warm-up: %d and %d new tokens in %.1f s",
            first,
            second,
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        pass

    def prepare(
        self, scheduled: list[ScheduledRequest], kv: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata and the rows to sample."""
        inputs, meta, rows, _ = self._prepare(scheduled, kv)
        return inputs[0], inputs[1], meta, rows

    def _prepare(
        self, scheduled: list[ScheduledRequest], kv: KVCacheManager
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
        """([3, T] int64 device: ids, positions, slots), metadata, sample rows, and the
        [B] int32 device KV lengths."""
        bs = self.layout.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        row_tables = []
        for s in scheduled:
            r = s.request
            start = r.num_computed_tokens
            end = start + s.num_new_tokens
            table = kv.block_table(r.request_id)
            row_tables.append((r.request_id, table))
            ids.extend(r.all_token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                sample_rows.append(qsl[-1] - 1)
        rows = self.tables.update(row_tables)
        num_tokens, num_seqs = len(ids), len(rows)
        # One upload: ids, positions, slots [T] each, then KV lengths and table rows [B].
        host = torch.tensor(ids + pos + slots + seq_lens + rows, dtype=torch.int64)
        dev = host.to(self.device, non_blocking=True)
        inputs = dev[: 3 * num_tokens].view(3, num_tokens)
        lens = dev[3 * num_tokens : 3 * num_tokens + num_seqs].to(torch.int32)
        row_idx = dev[3 * num_tokens + num_seqs :]
        width = -(-max(seq_lens) // bs)
        meta = AttentionMetadata(
            slot_mapping=inputs[2],
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=self.tables.table.index_select(0, row_idx)[:, :width],
            seq_lens_tensor=lens,
        )
        return inputs, meta, sample_rows, lens

    def _graph_step(
        self, scheduled: list[ScheduledRequest], kv: KVCacheManager
    ) -> torch.Tensor | bool | None:
        """A pure-decode step through the graphs: its logits (or None: no row samples);
        False when the step must run eagerly (not pure decode, too many rows, tables too
        wide). Host work: a few list entries per row, one H2D copy."""
        graphs = self.graphs
        assert graphs is not None
        n = len(scheduled)
        if n > graphs.max_batch or any(s.num_new_tokens != 1 for s in scheduled):
            return False
        bs = self.layout.block_size
        row_tables = [
            (s.request.request_id, kv.block_table(s.request.request_id)) for s in scheduled
        ]
        width = max(len(t) for _, t in row_tables)
        size = graphs.bucket(n, width)
        if size is None:
            return False
        rows = self.tables.update(row_tables)
        if graphs.block_tables.table is not graphs.source:  # cannot happen: sized above
            log.warning("the device block tables were reallocated: decode runs eagerly")
            return False
        ids, pos, slots, lens = [], [], [], []
        for s, (_, table) in zip(scheduled, row_tables, strict=True):
            r = s.request
            p = r.num_computed_tokens
            ids.append(r.all_token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(p + 1)
        logits = graphs.run(size, ids, pos, slots, lens, rows)
        sample = [i for i, s in enumerate(scheduled) if s.samples]
        if len(sample) == n:
            return logits.clone()  # the graph overwrites its output next step
        if not sample:
            return None
        return logits.index_select(0, torch.tensor(sample, device=self.device))

    @torch.inference_mode()
    def launch_ahead(
        self, scheduled: list[ScheduledRequest], kv: KVCacheManager, tokens: torch.Tensor
    ) -> bool:
        """Launch the decode step that follows `scheduled` (a step that just ran, every row
        decoding one token and sampling; called before its requests advance) with
        `tokens` [n] int64, the step's sampled tokens still on the device, as its input
        ids (engine/decode_ahead.py). The next `execute` takes its logits if the scheduler
        asks for that step. False, with nothing launched, when it cannot run through the
        graphs or a row has no KV slot yet for its next position."""
        self._ahead = None
        graphs = self.graphs
        n = len(scheduled)
        if graphs is None or n == 0 or tokens.shape != (n,) or n > graphs.max_batch:
            return False
        bs = self.layout.block_size
        row_tables = []
        pos: list[int] = []
        slots: list[int] = []
        for s in scheduled:
            r = s.request
            p = r.num_computed_tokens + 1  # the sampled token's position
            table = kv.block_table(r.request_id)
            if s.num_new_tokens != 1 or not s.samples or p >= self.max_len or p // bs >= len(table):
                return False
            row_tables.append((r.request_id, table))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        size = graphs.bucket(n, max(len(t) for _, t in row_tables))
        if size is None:
            return False
        rows = self.tables.update(row_tables)
        if graphs.block_tables.table is not graphs.source:
            return False
        lens = [p + 1 for p in pos]
        logits = graphs.run(size, [0] * n, pos, slots, lens, rows, device_ids=tokens)
        self._ahead = DecodeAhead([s.request for s in scheduled], pos, slots, logits.clone())
        self.ahead_launched += 1
        return True

    def drop_ahead(self) -> None:
        """Forget a launched step (its work is discarded)."""
        self._ahead = None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor | None:
        """Run one step; return logits [num_sampling_requests, V] (None if none sample):
        float32, except decode steps through a graph of more than one row, which return
        the lm_head's output in the model's dtype (the sampler casts it where it computes
        on the values; an argmax needs no cast, engine/sampler.py). A step launched
        ahead (launch_ahead) that computed exactly these rows is not run again: its
        logits are returned."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            logits = ahead.take(scheduled, kv, self.layout.block_size)
            if logits is not None:
                self.ahead_taken += 1
                return logits
        if self.graphs is not None:
            out = self._graph_step(scheduled, kv)
            if out is not False:
                assert not isinstance(out, bool)
                return out
        inputs, meta, rows, _ = self._prepare(scheduled, kv)
        hidden = self.model(inputs[0], inputs[1], self.kv_caches, meta)
        if not rows:
            return None
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        return logits.float()


@dataclass
class _WarmUpRow:
    """What execute reads of a request, for ModelRunner._warm_up."""

    all_token_ids: list[int]
    num_computed_tokens: int = 0
    request_id: str = "warm-up"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _WarmUpTables:
    """What execute reads of the KV cache manager: one block table."""

    blocks: list[int] = field(default_factory=list)

    def block_table(self, request_id: str) -> list[int]:
        return self.blocks

"""The "flex" attention backend: paged attention on CUDA. Decode rows run PyTorch
FlexAttention (torch.nn.attention.flex_attention, compiled to a Triton kernel by
torch.compile) reading the paged cache in place; prefill rows run SDPA's flash kernel.

Decode. The KV of a layer is viewed in place as ONE long sequence of num_blocks *
block_size slots, K = kv_cache[0] as [1, Hkv, slots, D] (a strided view, no copy).
FlexAttention's BlockMask names, for every batch row, the KV tiles to visit; with its KV
tile equal to one cache block, the tile list of a sequence IS its block table, so the
kernel reads the blocks where they lie (no gather):

    decode row b (one query, L_b local keys):
        tiles = block_table[b, :ceil(L_b / bs)]
        mask  = every slot, except the last block's slots >= L_b - (tiles - 1) * bs

Its LSE (natural log; asked for only by forward_with_lse, since converting it is one more
kernel per layer) is what merge_partials combines under decode context parallelism
(meta.dcp_size > 1: the cache holds local keys j of global position j * P + r; new tokens
of other ranks, slot -1, are not written). Rows are padded to a few
batch sizes and table widths so that the kernel compiles for a bounded set of shapes
(static shapes keep FlexAttention's split-KV decode kernel; a dynamic batch would fall
back to its prefill kernel). Decode is graph-safe: with meta.seq_lens_tensor and
block_tables in static buffers the mask is built by device ops only, so a CUDA graph
replays it (engine/cuda_graphs.py).

The new tokens' K and V go into the cache in one Triton launch on CUDA
(flex_kv_write.py; two index_copy_ calls elsewhere).

Prefill. Long rows (at least flex_prefill.MIN_PAIRS query-key pairs) run cuDNN's fused
attention, about 1.7x FlashAttention-2's rate on an H200: the prefix blocks gathered into
one contiguous K/V, the work split into a maskless part over the prefix and a causal
square over the row's own keys, merged by their LSEs, shapes bucketed so that cuDNN's
per-shape plans stay few (flex_prefill.py). Shorter rows run SDPA's flash kernel: with
no cached prefix causal over the new k/v directly; behind a prefix over the gathered
blocks with a lower-right causal bias (no materialized mask). The flash kernel is named
explicitly there: SDPA would otherwise pick cuDNN for the no-prefix rows and build a plan
for every new prompt length (45-80 ms each). LSE is not needed there outside DCP; a DCP
step with prefill rows runs the reference LSE backend (torch_lse) whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import flex_kv_write, flex_prefill
from engine.attention.base import AttentionMetadata, LSEAttentionBackend, register_backend
from engine.attention.kv_quant import is_fp8_cache
from engine.attention.torch_lse import TorchLSEAttentionBackend
from engine.triton_support import triton_runs_on

_Q_BLOCK = 128
"""Query rows per BlockMask row (FlexAttention's default tile; decode uses one)."""

DECODE_STAGES = 3
"""Software-pipelining stages of the decode kernel's KV loop: with one-block (16-slot) KV
tiles, three loads in flight read the paged cache at ~3.8 TB/s on an H200 (batch 128 x
1K: 140 us per layer against 175 us with the template's default; docs/benchmarks.md)."""

ROPE_IN_WRITE = True
"""Pure-decode steps of more than one row rotate q and k in the K/V write's kernel
(rotates_on_write, flex_kv_write.rope_write); False: the layer's compiled glue rotates
them and the write is a kernel of its own (benchmarks/gpu_engine.py compares the two)."""

DECODE_LSE_ALWAYS = False
"""Benchmarks set this to compare: the decode kernel returns its LSE even where the step
needs none (outside decode context parallelism its conversion is one more kernel per
layer)."""

_FLEX: Callable[..., Any] | None = None
DEFAULT_KERNEL: Callable[..., Any] | None = None
"""The decode kernel of backends built without one; None = compiled flex_attention.
(Tests on CPU set the tile simulator here.)"""


def _flex() -> Callable[..., Any]:
    """flex_attention compiled once per process, for static shapes (one kernel per padded
    batch size and table width). The recompile limit is raised above the number of such
    shapes: past it torch would fall back to the unfused kernel, which materializes scores
    over the whole cache."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _FLEX = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return _FLEX


def _flash_first(device: torch.device) -> Any:
    """SDPA restricted to the flash kernel (then memory-efficient, then math) on CUDA:
    short prefill rows of every length would otherwise build a cuDNN plan each."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        set_priority=True,
    )


def padded_batch(n: int) -> int:
    """The batch size decode rows are padded to: powers of two up to 8, then multiples of
    8 up to 32, of 16 up to 128, of 32 beyond (the CUDA graph buckets use the same sizes)."""
    if n <= 8:
        return 1 << max(0, (n - 1).bit_length())
    step = 8 if n <= 32 else 16 if n <= 128 else 32
    return -(-n // step) * step


def _padded_width(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Plan:
    write_rows: torch.Tensor | None  # rows of new tokens held here; None = all
    write_slots: torch.Tensor
    decode_rows: torch.Tensor | slice | None = None
    num_decode: int = 0
    decode_mask: Any = None  # BlockMask over padded_batch(num_decode) rows
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # q_start, q_end, b


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan) -> None:
    """The step's new K and V rows into the paged cache at the plan's slots: one Triton
    launch where it runs (flex_kv_write.write), index_copy_ otherwise."""
    if plan.write_rows is None and flex_kv_write.usable(k, v, kv_cache):
        flex_kv_write.write(k, v, kv_cache, plan.write_slots)  # K and V in one launch
        return
    num_kv_heads, head_dim = kv_cache.shape[3:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    k_new = k if plan.write_rows is None else k.index_select(0, plan.write_rows)
    v_new = v if plan.write_rows is None else v.index_select(0, plan.write_rows)
    flat[0].index_copy_(0, plan.write_slots, k_new.to(kv_cache.dtype))
    flat[1].index_copy_(0, plan.write_slots, v_new.to(kv_cache.dtype))


@register_backend
class FlexAttentionBackend(LSEAttentionBackend):
    """Paged FlexAttention decode + flash prefill (CUDA only); no state between steps."""

    name = "flex"
    graph_safe_decode = True

    def __init__(
        self,
        kernel: Callable[..., Any] | None = None,
        dense: flex_prefill.Dense | None = None,
    ) -> None:
        self._kernel = kernel if kernel is not None else DEFAULT_KERNEL
        """flex_attention's signature; None = the compiled kernel (CUDA). Tests on CPU pass
        a simulator of the kernel's tile semantics."""
        self._dense = dense
        """The dense attention long prefill rows run (flex_prefill.Dense); None = cuDNN's
        where flex_prefill.usable holds, else the flash path. Tests on CPU pass
        flex_prefill.math_dense."""
        self.long_prefill_pairs = flex_prefill.MIN_PAIRS
        """Rows with fewer query-key pairs take the flash path (tests lower it)."""
        self._reference = TorchLSEAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        if meta.dcp_size > 1 or is_fp8_cache(kv_cache):
            return self.forward_with_lse(q, k, v, kv_cache, meta, scale)[0]
        return self._run(q, k, v, kv_cache, meta, scale, need_lse=DECODE_LSE_ALWAYS)[0]

    def forward_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hq] float32
        if is_fp8_cache(kv_cache) or any(n > 1 for n in meta.query_lens()):
            # fp8 rows (engine/attention/kv_quant.py) are dequantized by the reference
            return self._reference.forward_with_lse(q, k, v, kv_cache, meta, scale)
        out, lse = self._run(q, k, v, kv_cache, meta, scale)
        assert lse is not None
        return out, lse

    def rotates_on_write(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """Pure-decode steps (no prefill row, no DCP, a 16-bit or float32 cache) where
        the Triton write runs: RoPE goes into it (flex_kv_write.rope_write)."""
        if not (ROPE_IN_WRITE and meta.rope_in_write) or meta.dcp_size > 1:
            return False
        if is_fp8_cache(kv_cache):
            return False
        if not triton_runs_on(kv_cache.device):
            return False
        if self._kernel is None and kv_cache.device.type != "cuda":
            return False
        plan = self._plan(meta, kv_cache)
        return not plan.prefills and plan.decode_mask is not None and plan.write_rows is None

    def forward_rotating(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.rotates_on_write(meta, kv_cache) and flex_kv_write.rope_usable(
            q, k, v, cos, sin, kv_cache
        ):
            slots = self._plan(meta, kv_cache).write_slots
            q = flex_kv_write.rope_write(q, k, v, cos, sin, kv_cache, slots)
            return self._run(q, k, v, kv_cache, meta, scale, DECODE_LSE_ALWAYS, written=True)[0]
        return super().forward_rotating(q, k, v, cos, sin, kv_cache, meta, scale)

    def _plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> _Plan:
        """The step's plan, built on first use (the first layer) and shared by all."""
        plan = meta.backend_state.get(self.name)
        if plan is None:
            _, num_blocks, block_size = kv_cache.shape[:3]
            plan = self._build_plan(meta, block_size, num_blocks, kv_cache.device)
            meta.backend_state[self.name] = plan
        return plan

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        need_lse: bool = True,
        written: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Out for every row, and LSE for every row when the step has no prefill rows
        and `need_lse` (without it the decode kernel skips the LSE's own kernel).
        `written`: k and v are in the cache already (forward_rotating)."""
        if self._kernel is None and q.device.type != "cuda":
            raise RuntimeError(
                "the flex attention backend runs on CUDA only; use attention_backend='torch' on CPU"
            )
        _, _, block_size, _, head_dim = kv_cache.shape
        if block_size < 16:
            raise ValueError(f"the flex backend needs block_size >= 16, got {block_size}")
        num_tokens, num_heads, _ = q.shape
        plan = self._plan(meta, kv_cache)
        if not written:
            _write_kv(k, v, kv_cache, plan)

        o_dec = lse_dec = None
        if plan.decode_mask is not None:
            rows = plan.decode_rows
            assert rows is not None
            q_dec = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
            o_dec, lse_dec = self._decode(q_dec, kv_cache, plan, scale, need_lse)
            if not plan.prefills and isinstance(rows, slice):
                return o_dec, lse_dec  # pure decode: rows 0..B-1 in order
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        lse: torch.Tensor | None = None
        if o_dec is not None:
            out[plan.decode_rows] = o_dec
            if not plan.prefills and lse_dec is not None:
                lse = torch.empty(num_tokens, num_heads, device=q.device)
                lse[plan.decode_rows] = lse_dec
        for q_start, q_end, b in plan.prefills:
            out[q_start:q_end] = self._prefill(q, k, v, kv_cache, meta, b, q_start, q_end, scale)
        return out, lse

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [Bd, Hq, D], [Bd, Hq] (None: not needed)
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        num_seqs, num_heads, _ = q.shape
        padded = padded_batch(num_seqs)
        if padded > num_seqs:
            q = F.pad(q, (0, 0, 0, 0, 0, padded - num_seqs))
        # [1, Hkv, slots, D] views of the whole cache: the kernel reads blocks in place.
        keys = kv_cache[0].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        kernel = self._kernel or _flex()
        got = kernel(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            keys,
            values,
            block_mask=plan.decode_mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
            return_lse=need_lse,
            kernel_options=self._decode_options(kv_cache, padded, q.device),
        )
        if not need_lse:
            return got[:num_seqs, :, 0], None
        o, lse = got
        return o[:num_seqs, :, 0], lse[:num_seqs, :, 0]

    @staticmethod
    def _decode_options(kv_cache: torch.Tensor, batch: int, device: torch.device) -> dict[str, Any]:
        # The KV tile must divide the BlockMask's KV block (one cache block). Split each
        # row's KV over enough programs to fill the GPU ~4 times over (the default split
        # leaves one program per (row, KV head) from 17 rows of 8 KV heads on).
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        options: dict[str, Any] = {"BLOCK_N": min(block_size, 64)}
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            options["SPLIT_KV"] = max(1, -(-4 * sms // (batch * num_kv_heads)))
            options["num_stages"] = DECODE_STAGES
        return options

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        b: int,
        q_start: int,
        q_end: int,
        scale: float,
    ) -> torch.Tensor:  # [q_len, Hq, D]
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        q_len, seq_len = q_end - q_start, meta.seq_lens[b]
        prefix = seq_len - q_len
        dense = self._dense
        if dense is None and flex_prefill.usable(q, kv_cache):
            dense = flex_prefill.cudnn_dense
        if dense is not None and flex_prefill.wanted(prefix, q_len, self.long_prefill_pairs):
            return flex_prefill.prefill(
                q[q_start:q_end],
                k[q_start:q_end],
                v[q_start:q_end],
                kv_cache,
                meta.block_tables[b],
                prefix,
                scale,
                dense,
            )
        q_s = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        gqa = q.shape[1] != num_kv_heads
        with _flash_first(q.device):
            if not prefix and kv_cache.dtype == q.dtype:  # no prefix: the new k/v are all
                k_s = k[q_start:q_end].transpose(0, 1).unsqueeze(0)
                v_s = v[q_start:q_end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    q_s, k_s, v_s, is_causal=True, scale=scale, enable_gqa=gqa
                )
            else:
                from torch.nn.attention.bias import causal_lower_right

                blocks = meta.block_tables[b, : -(-seq_len // block_size)]
                kv = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)
                kv = kv.view(2, -1, num_kv_heads, head_dim)[:, :seq_len].to(q.dtype)
                kv = kv.transpose(1, 2).unsqueeze(1)  # [2, 1, Hkv, seq_len, D]
                o = F.scaled_dot_product_attention(
                    q_s,
                    kv[0],
                    kv[1],
                    attn_mask=causal_lower_right(q_len, seq_len),
                    scale=scale,
                    enable_gqa=gqa,
                )
        return o[0].transpose(0, 1)

    # -- per-step plan (built on the first layer, shared by all) -------------------------
    def _build_plan(
        self, meta: AttentionMetadata, block_size: int, num_blocks: int, device: torch.device
    ) -> _Plan:
        size, rank = meta.dcp_size, meta.dcp_rank
        slots = meta.slot_mapping
        if size == 1:
            plan = _Plan(None, slots)
        else:
            write_rows = torch.nonzero(slots >= 0).flatten()
            plan = _Plan(write_rows, slots.index_select(0, write_rows))
        q_lens, seq_lens, starts = meta.query_lens(), meta.seq_lens, meta.query_start_loc
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        if decode:
            if len(decode) == len(q_lens):
                tables, lens = meta.block_tables, meta.seq_lens_tensor
                plan.decode_rows = slice(0, len(decode))
            else:
                idx = torch.tensor(decode, dtype=torch.int64, device=device)
                tables = meta.block_tables.index_select(0, idx)
                lens = None if meta.seq_lens_tensor is None else meta.seq_lens_tensor[idx]
                plan.decode_rows = torch.tensor([starts[b] for b in decode], device=device)
            if lens is None:
                lens = torch.tensor([seq_lens[b] for b in decode], device=device)
            num = len(decode)
            padded, width = padded_batch(num), _padded_width(tables.shape[1])
            if padded > num or width > tables.shape[1]:
                # Padding rows: one key in block 0 (read only, output dropped).
                tables = F.pad(tables, (0, width - tables.shape[1], 0, padded - num))
                lens = F.pad(lens, (0, padded - num), value=1)
            plan.num_decode = num
            plan.decode_mask = decode_block_mask(
                tables, lens, block_size, num_blocks * block_size, size, rank
            )
        plan.prefills = [(starts[b], starts[b + 1], b) for b, n in enumerate(q_lens) if n > 1]
        return plan


def decode_block_mask(
    tables: torch.Tensor,  # [B, W] block ids (int32 or int64, device)
    seq_lens: torch.Tensor,  # [B] global KV lengths (device)
    block_size: int,
    num_slots: int,
    size: int = 1,
    rank: int = 0,
) -> Any:
    """The BlockMask of B one-token queries, each over its sequence's local keys: every
    block of the row's table is a (masked) tile, the mask keeping all slots but the
    last block's unused tail. Device ops only (no host sync), so a CUDA graph can replay
    it on new values.

    No tile is marked "full": FlexAttention's decode kernel splits a row's work over its
    own tile count only when no row has full tiles (with full tiles it splits the whole
    KV length, here every slot of the cache, leaving all but one split idle)."""
    from torch.nn.attention.flex_attention import BlockMask

    num_seqs, width = tables.shape
    lens = seq_lens.to(torch.int32)
    if size > 1:  # local keys j * size + rank < seq_len
        lens = (lens - rank + size - 1).clamp(min=0) // size
    tables = tables.to(torch.int32)
    num_tiles = (lens + block_size - 1) // block_size
    last_len = lens - (num_tiles - 1).clamp(min=0) * block_size  # 1..bs (0: no keys)
    last = tables.gather(1, (num_tiles - 1).clamp(min=0).long().unsqueeze(1)).squeeze(1)

    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Evaluated on the row's own blocks only: all slots except the last block's tail.
        return (kv_idx // block_size != last[b]) | (kv_idx % block_size < last_len[b])

    return BlockMask.from_kv_blocks(
        num_tiles.view(num_seqs, 1, 1),
        tables.view(num_seqs, 1, 1, width),
        BLOCK_SIZE=(_Q_BLOCK, block_size),
        mask_mod=mask,
        seq_lengths=(1, num_slots),
        compute_q_blocks=False,
    )

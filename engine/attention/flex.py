"""The "flex" attention backend: paged attention on CUDA with PyTorch FlexAttention
(torch.nn.attention.flex_attention, compiled to Triton kernels by torch.compile).

The KV of a layer is viewed in place as ONE long sequence of num_blocks * block_size
slots, K = kv_cache[0] as [1, Hkv, slots, D] (a strided view, no copy). FlexAttention's
BlockMask names, for every (batch row, query block), the KV tiles to visit; with its KV
tile equal to one cache block, the tile list of a sequence IS its block table, so the
kernel reads the paged cache where it lies (no gather):

    decode row b (one query, L_b local keys, nf = L_b // bs full blocks):
        full tiles    = block_table[b, :nf]       (no mask evaluated)
        partial tile  = block_table[b, nf]        (mask: slot % bs < L_b % bs)

    prefill sequence (q_len new tokens behind ctx cached ones), query block m covering
    positions pf ..= pl:
        full tiles    = blocks whose keys are all <= pf
        partial tiles = the few blocks straddling pf .. pl (causal mask, below)

FlexAttention evaluates the mask only on partial tiles. The prefill mask maps a slot to
its position through `page_logical[block]` (the block's index in its sequence's table):
a cached block sits at the same index in every sequence sharing it (prefix blocks are
chained by position), so one table serves all sequences of a step.

Decode context parallelism (meta.dcp_size > 1): the cache holds local keys j of global
position j * P + r; the masks compare global positions, and new tokens of other ranks
(slot -1) are not written. Each call returns the LSE too (natural log), which
merge_partials combines.

Decode is graph-safe: with meta.seq_lens_tensor and block_tables in static buffers, the
decode mask is built by device ops only, so a CUDA graph replays it (engine/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.base import AttentionMetadata, LSEAttentionBackend, register_backend

_Q_BLOCK = 128
"""Query rows per BlockMask row (FlexAttention's default tile)."""

_FLEX: Callable[..., Any] | None = None


def _flex() -> Callable[..., Any]:
    """flex_attention compiled once per process. Step shapes vary (batch, prompt
    length), so the recompile limit is raised: past it torch would fall back to the
    unfused kernel, which materializes scores over the whole cache."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _FLEX = torch.compile(flex_attention, fullgraph=True)
    return _FLEX


def _visible(pos: int, size: int, rank: int) -> int:
    """How many local keys (global position j * size + rank) are <= pos."""
    return (pos - rank) // size + 1 if pos >= rank else 0


@dataclass
class _Call:
    """One flex_attention call of the step: its query rows and its mask."""

    rows: torch.Tensor | slice
    q_len: int
    block_mask: Any  # BlockMask


@dataclass
class _Plan:
    write_rows: torch.Tensor | None  # rows of new tokens held here; None = all
    write_slots: torch.Tensor
    decode: _Call | None = None
    prefills: list[_Call] = field(default_factory=list)
    pure_decode: bool = False


@register_backend
class FlexAttentionBackend(LSEAttentionBackend):
    """Paged FlexAttention (CUDA only); keeps one scratch table (page_logical) between
    steps, sized by the cache."""

    name = "flex"
    graph_safe_decode = True

    def __init__(self, kernel: Callable[..., Any] | None = None) -> None:
        self._page_logical: torch.Tensor | None = None
        self._kernel = kernel
        """flex_attention's signature; None = the compiled kernel (CUDA). Tests on CPU pass
        a simulator of the kernel's tile semantics."""

    def kernel_options(self, block_size: int) -> dict[str, Any]:
        # The KV tile must divide the BlockMask's KV block (one cache block).
        return {"BLOCK_N": min(block_size, 64)}

    def forward_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hq] float32
        if self._kernel is None and q.device.type != "cuda":
            raise RuntimeError(
                "the flex attention backend runs on CUDA only; use attention_backend='torch' on CPU"
            )
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if block_size < 16:
            raise ValueError(f"the flex backend needs block_size >= 16, got {block_size}")
        num_tokens, num_heads, _ = q.shape
        plan = meta.backend_state.get(self.name)
        if plan is None:
            plan = self._build_plan(meta, block_size, num_blocks, q.device)
            meta.backend_state[self.name] = plan
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        k_new = k if plan.write_rows is None else k.index_select(0, plan.write_rows)
        v_new = v if plan.write_rows is None else v.index_select(0, plan.write_rows)
        flat[0].index_copy_(0, plan.write_slots, k_new.to(kv_cache.dtype))
        flat[1].index_copy_(0, plan.write_slots, v_new.to(kv_cache.dtype))

        # [1, Hkv, slots, D] views of the whole cache: the kernel reads blocks in place.
        keys = kv_cache[0].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1].view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        options = self.kernel_options(block_size)
        gqa = num_heads != num_kv_heads
        kernel = self._kernel or _flex()

        def run(qs: torch.Tensor, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
            return kernel(  # type: ignore[no-any-return]
                qs,
                keys,
                values,
                block_mask=call.block_mask,
                scale=scale,
                enable_gqa=gqa,
                return_lse=True,
                kernel_options=options,
            )

        if plan.pure_decode:
            assert plan.decode is not None
            o, lse = run(q.unsqueeze(2), plan.decode)  # [B, Hq, 1, D], [B, Hq, 1]
            return o.squeeze(2), lse.squeeze(2)

        out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        lse_out = torch.full((num_tokens, num_heads), float("-inf"), device=q.device)
        if plan.decode is not None:
            rows = plan.decode.rows
            q_dec = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
            o, lse = run(q_dec.unsqueeze(2), plan.decode)
            out[rows] = o.squeeze(2)
            lse_out[rows] = lse.squeeze(2)
        for call in plan.prefills:
            rows = call.rows
            assert isinstance(rows, slice)
            o, lse = run(q[rows].transpose(0, 1).unsqueeze(0), call)  # [1, Hq, L, D]
            out[rows] = o[0].transpose(0, 1)
            lse_out[rows] = lse[0].transpose(0, 1)
        return out, lse_out

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
        num_slots = num_blocks * block_size
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        if decode:
            if len(decode) == len(q_lens):
                tables, lens = meta.block_tables, meta.seq_lens_tensor
                rows: torch.Tensor | slice = slice(0, len(decode))
                plan.pure_decode = True
            else:
                idx = torch.tensor(decode, dtype=torch.int64, device=device)
                tables = meta.block_tables.index_select(0, idx)
                lens = None if meta.seq_lens_tensor is None else meta.seq_lens_tensor[idx]
                rows = torch.tensor([starts[b] for b in decode], device=device)
            if lens is None:
                lens = torch.tensor([seq_lens[b] for b in decode], device=device)
            mask = decode_block_mask(tables, lens, block_size, num_slots, size, rank)
            plan.decode = _Call(rows, 1, mask)
        for b, q_len in enumerate(q_lens):
            if q_len > 1:
                table = meta.block_tables[b]
                mask = self._prefill_block_mask(
                    table, seq_lens[b] - q_len, q_len, block_size, num_blocks, size, rank
                )
                plan.prefills.append(_Call(slice(starts[b], starts[b + 1]), q_len, mask))
        return plan

    def _prefill_block_mask(
        self,
        table: torch.Tensor,  # [W] block ids of the sequence (padded)
        ctx: int,
        q_len: int,
        block_size: int,
        num_blocks: int,
        size: int,
        rank: int,
    ) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        device = table.device
        if self._page_logical is None or self._page_logical.numel() != num_blocks:
            self._page_logical = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        page_logical = self._page_logical
        num_pages = -(-_visible(ctx + q_len - 1, size, rank) // block_size)
        table = table[:num_pages].to(torch.int32)
        if num_pages:
            page_logical.index_copy_(
                0, table.long(), torch.arange(num_pages, dtype=torch.int32, device=device)
            )
        full, partial = [], []
        for start in range(0, q_len, _Q_BLOCK):
            first, last = ctx + start, ctx + min(start + _Q_BLOCK, q_len) - 1
            nf = _visible(first, size, rank) // block_size
            need = -(-_visible(last, size, rank) // block_size)
            full.append(nf)
            partial.append(need - nf)
        nqb = len(full)
        width = max(1, max(partial))
        full_t = torch.tensor(full, dtype=torch.int32)
        part_t = torch.tensor(partial, dtype=torch.int32)
        pos = (full_t.unsqueeze(1) + torch.arange(width, dtype=torch.int32)).clamp(
            max=max(num_pages - 1, 0)
        )
        pos = pos.to(device)
        if num_pages:
            part_idx = table[pos.long()]
            full_idx = table.unsqueeze(0).expand(nqb, num_pages).contiguous()
        else:  # no key of this sequence on this rank: nothing to visit
            part_idx = torch.zeros(nqb, width, dtype=torch.int32, device=device)
            full_idx = torch.zeros(nqb, 1, dtype=torch.int32, device=device)
        ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            local = page_logical[kv_idx // block_size] * block_size + kv_idx % block_size
            return local * size + rank <= ctx_t + q_idx

        return BlockMask.from_kv_blocks(
            part_t.to(device).view(1, 1, nqb),
            part_idx.view(1, 1, nqb, width),
            full_t.to(device).view(1, 1, nqb),
            full_idx.view(1, 1, nqb, -1),
            BLOCK_SIZE=(_Q_BLOCK, block_size),
            mask_mod=causal,
            seq_lengths=(q_len, num_blocks * block_size),
            compute_q_blocks=False,
        )


def decode_block_mask(
    tables: torch.Tensor,  # [B, W] block ids (int32 or int64, device)
    seq_lens: torch.Tensor,  # [B] global KV lengths (device)
    block_size: int,
    num_slots: int,
    size: int = 1,
    rank: int = 0,
) -> Any:
    """The BlockMask of B one-token queries, each over its sequence's local keys: full
    tiles are the whole blocks, one partial tile the last block's first L % bs slots.
    Device ops only (no host sync), so a CUDA graph can replay it on new values."""
    from torch.nn.attention.flex_attention import BlockMask

    num_seqs, width = tables.shape
    lens = seq_lens.to(torch.int32)
    if size > 1:  # local keys j * size + rank < seq_len
        lens = (lens - rank + size - 1).clamp(min=0) // size
    tables = tables.to(torch.int32)
    num_full = lens // block_size
    rem = lens - num_full * block_size
    last = tables.gather(1, num_full.clamp(max=width - 1).long().unsqueeze(1))

    def tail(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Evaluated on the partial tile only: the last block's valid slots.
        return kv_idx % block_size < rem[b]

    return BlockMask.from_kv_blocks(
        (rem > 0).to(torch.int32).view(num_seqs, 1, 1),
        last.view(num_seqs, 1, 1, 1),
        num_full.view(num_seqs, 1, 1),
        tables.view(num_seqs, 1, 1, width),
        BLOCK_SIZE=(_Q_BLOCK, block_size),
        mask_mod=tail,
        seq_lengths=(1, num_slots),
        compute_q_blocks=False,
    )

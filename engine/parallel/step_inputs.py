"""One scheduled step as a StepBatch (what the driver sends), and the tensors each rank or
stage builds from it for its own cache.

The driver's scheduler counts blocks of `block_size * dcp_size` tokens (a "virtual
block"); a rank of a DCP group keeps its stripe of each virtual block in one local block
of `block_size` tokens with the SAME block id, so every rank shares the driver's tables:

    dcp_size 2, block_size 4: virtual block b holds tokens 8b .. 8b+7
        rank 0: tokens 8b, 8b+2, 8b+4, 8b+6 -> local block b, offsets 0 1 2 3
        rank 1: tokens 8b+1, 8b+3, ...      -> local block b, offsets 0 1 2 3
    token t on rank t % P: local position j = t // P,
        slot = table[j // block_size] * block_size + j % block_size

Without DCP (and for pipeline stages) P = 1 and this is the engine's usual slot.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import ScheduledRequest
from protocol.rank_messages import StepBatch


def build_batch(
    scheduled: list[ScheduledRequest], kv: KVCacheManager, *, with_ids: bool = True
) -> tuple[StepBatch, list[int]]:
    """The step's flat batch (before num_computed_tokens advances) and the query rows to
    sample (one per request that samples, its last new token)."""
    ids: list[int] = []
    positions: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    for s in scheduled:
        r = s.request
        start = r.num_computed_tokens
        end = start + s.num_new_tokens
        if with_ids:
            ids.extend(r.all_token_ids[start:end])
        positions.extend(range(start, end))
        qsl.append(qsl[-1] + s.num_new_tokens)
        seq_lens.append(end)
        tables.append(list(kv.block_table(r.request_id)))
        if s.samples:
            rows.append(qsl[-1] - 1)
    return StepBatch(ids, positions, qsl, seq_lens, tables), rows


def batch_tensors(
    batch: StepBatch,
    device: torch.device,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata]:
    """(input_ids or None, positions, attention metadata) for a cache of `block_size`
    token blocks holding the stripe t ≡ dcp_rank (mod dcp_size) (module docstring)."""
    slots: list[int] = []
    for b, table in enumerate(batch.block_tables):
        q0, q1 = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        for t in batch.positions[q0:q1]:
            if t % dcp_size != dcp_rank:
                slots.append(-1)
                continue
            j = t // dcp_size
            slots.append(table[j // block_size] * block_size + j % block_size)
    width = max((len(t) for t in batch.block_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in batch.block_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=list(batch.query_start_loc),
        seq_lens=list(batch.seq_lens),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
    )
    ids = (
        torch.tensor(batch.input_ids, dtype=torch.long, device=device) if batch.input_ids else None
    )
    positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
    return ids, positions, meta

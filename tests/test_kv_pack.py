"""gather/scatter against a per-token reference, round trips, DCP/head shards, errors."""

from __future__ import annotations

import random

import pytest
import torch

from transfer import FULL, KVShard, PackLayoutError, gather, packed_view, scatter

L, NUM_BLOCKS, BS, H, D = 3, 40, 4, 4, 8


def make_cache(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BS, H, D, generator=g).to(dtype) for _ in range(L)]


def reference_gather(
    kv: list[torch.Tensor], table: list[int], start: int, end: int, shard: KVShard = FULL
) -> torch.Tensor:
    """The definition: one token at a time."""
    h0, h1 = shard.heads(H)
    toks = [t for t in range(start, end) if t % shard.dcp_size == shard.dcp_rank]
    out = torch.empty(L, 2, len(toks), h1 - h0, D, dtype=kv[0].dtype)
    for layer in range(L):
        for k in range(2):
            for i, t in enumerate(toks):
                out[layer, k, i] = kv[layer][k, table[t // BS], t % BS, h0:h1]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_reference_and_scatter_inverts_it(seed: int, dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    kv = make_cache(seed, dtype)
    num_tokens = rng.randint(1, 30 * BS)
    table = rng.sample(range(NUM_BLOCKS), -(-num_tokens // BS))
    start = rng.randint(0, num_tokens - 1)
    end = rng.randint(start + 1, num_tokens)
    out = torch.empty(L, 2, end - start, H, D, dtype=dtype)
    gather(kv, table, start, end, out)
    assert torch.equal(out, reference_gather(kv, table, start, end))

    dst = [torch.zeros_like(x) for x in kv]
    scatter(out, dst, table, start, end)
    again = torch.empty_like(out)
    gather(dst, table, start, end, again)
    assert torch.equal(again, out)
    touched = sum(int((x != 0).any(dim=(0, 3, 4)).sum()) for x in dst)
    assert touched <= L * (end - start)  # nothing outside the range was written


def test_gather_into_a_staging_view() -> None:
    kv = make_cache(1)
    table = list(range(10))
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    view = packed_view(staging, 256, (L, 2, 17, H, D), torch.float32)
    gather(kv, table, 5, 22, view)
    assert torch.equal(view, reference_gather(kv, table, 5, 22))
    assert int(staging[:256].sum()) == 0


@pytest.mark.parametrize(
    "dcp_size,dcp_rank,heads", [(2, 0, (0, 2)), (2, 1, (2, 4)), (4, 3, (1, 3))]
)
def test_shard_lands_at_local_positions(
    dcp_size: int, dcp_rank: int, heads: tuple[int, int]
) -> None:
    """A decode rank holding heads [h0, h1) and tokens t ≡ r (mod dcp) stores token t at
    local position t // dcp of its own (smaller) cache."""
    shard = KVShard(head_start=heads[0], head_end=heads[1], dcp_size=dcp_size, dcp_rank=dcp_rank)
    kv = make_cache(2)
    table = random.Random(3).sample(range(NUM_BLOCKS), 30)
    start, end = 13, 101
    n = shard.num_tokens(start, end)
    out = torch.empty(L, 2, n, heads[1] - heads[0], D)
    gather(kv, table, start, end, out, shard)
    assert torch.equal(out, reference_gather(kv, table, start, end, shard))

    local = [torch.zeros(2, NUM_BLOCKS, BS, heads[1] - heads[0], D) for _ in range(L)]
    local_table = list(range(NUM_BLOCKS))[::-1]
    scatter(out, local, local_table, start, end, shard)
    for t in range(start, end):
        if t % dcp_size != dcp_rank:
            continue
        p = t // dcp_size
        got = local[1][:, local_table[p // BS], p % BS]
        assert torch.equal(got, kv[1][:, table[t // BS], t % BS, heads[0] : heads[1]])


def test_shard_token_counts() -> None:
    rng = random.Random(0)
    for _ in range(500):
        size = rng.randint(1, 5)
        shard = KVShard(dcp_size=size, dcp_rank=rng.randrange(size))
        start = rng.randint(0, 50)
        end = rng.randint(start, 80)
        toks = shard.tokens(start, end).tolist()
        assert toks == [t for t in range(start, end) if t % size == shard.dcp_rank]
        assert shard.num_tokens(start, end) == len(toks)


def test_errors_are_typed() -> None:
    kv = make_cache(0)
    with pytest.raises(PackLayoutError, match="beyond the block table"):
        gather(kv, [0, 1], 0, 3 * BS, torch.empty(L, 2, 3 * BS, H, D))
    with pytest.raises(PackLayoutError, match="gather out"):
        gather(kv, [0, 1], 0, 4, torch.empty(L, 2, 5, H, D))
    with pytest.raises(PackLayoutError, match="scatter src"):
        scatter(torch.empty(L, 2, 4, H, D, dtype=torch.float16), kv, [0], 0, 4)
    with pytest.raises(PackLayoutError, match="aligned"):
        packed_view(torch.zeros(64, dtype=torch.uint8), 2, (2,), torch.float32)
    with pytest.raises(PackLayoutError, match="does not fit"):
        packed_view(torch.zeros(64, dtype=torch.uint8), 0, (17,), torch.float32)
    with pytest.raises(PackLayoutError):
        KVShard(dcp_size=2, dcp_rank=2)


def test_mla_latent_cache_one_part_dcp_stripes() -> None:
    """An MLA cache [1, blocks, bs, 1, C]: the packed segment is [L, 1, n, 1, C] (one row
    per layer); the DCP stripes of every rank together are the whole latent, each written
    into its rank's local cache at t // dcp_size, the head range [0, 1) on every rank."""
    from prefill_worker.pool_pack import pack_blocks, unpack_blocks

    g = torch.Generator().manual_seed(3)
    c = 40
    kv = [torch.randn(1, NUM_BLOCKS, BS, 1, c, generator=g) for _ in range(L)]
    table = random.Random(0).sample(range(NUM_BLOCKS), 8)
    start, end = 3, 29
    whole = torch.empty(L, 1, end - start, 1, c)
    gather(kv, table, start, end, whole)
    for layer in range(L):
        for i, t in enumerate(range(start, end)):
            assert torch.equal(whole[layer, 0, i], kv[layer][0, table[t // BS], t % BS])
    for rank in range(2):
        shard = KVShard(0, 1, dcp_size=2, dcp_rank=rank)
        n = shard.num_tokens(start, end)
        part = torch.empty(L, 1, n, 1, c)
        gather(kv, table, start, end, part, shard)
        assert torch.equal(part, whole[:, :, (rank - start) % 2 :: 2])
        local = [torch.zeros(1, NUM_BLOCKS, BS, 1, c) for _ in range(L)]
        local_table = list(range(NUM_BLOCKS // 2))
        scatter(part, local, local_table, start, end, shard)
        for t in shard.tokens(start, end).tolist():
            p = t // 2
            assert torch.equal(local[1][0, p // BS, p % BS], kv[1][0, table[t // BS], t % BS])
    # pool payloads: whole blocks, one part per layer
    blocks = table[:3]
    payload = torch.empty(L, 1, 3 * BS, 1, c)
    pack_blocks(kv, blocks, payload)
    dst = [torch.zeros_like(x) for x in kv]
    unpack_blocks(payload, dst, blocks)
    for a, b in zip(kv, dst, strict=True):
        assert torch.equal(a[:, blocks], b[:, blocks])

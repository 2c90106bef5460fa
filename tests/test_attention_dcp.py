"""Conformance of every LSEAttentionBackend (the DCP path) against dense attention:
P ranks each hold the token stripe t ≡ r (mod P) in their own paged cache; their partial
outputs merged by log-sum-exp must equal attention over all tokens, the LSE must equal
the dense log-sum-exp, and each rank's cache must hold exactly its stripe (with an fp8
cache: its rows quantized, the merge over the dequantized values)."""

from __future__ import annotations

import random

import pytest
import torch
from test_attention_backends import make_backend, seen, stored

from engine.attention.base import (
    _BACKENDS,
    AttentionMetadata,
    LSEAttentionBackend,
    get_backend,
    merge_partials,
)

HQ, HKV, D = 6, 2, 16
NUM_BLOCKS = 48


def _lse_backends() -> list[str]:
    get_backend("torch")  # registers the built-in backends
    return sorted(n for n, cls in _BACKENDS.items() if issubclass(cls, LSEAttentionBackend))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out [q_len, Hq, D], lse [q_len, Hq]) of the last q_len of seq_len positions."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.double().repeat_interleave(HQ // HKV, dim=1)
    v = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


def _run(
    backend_name: str, seqs: list[tuple[int, int]], dcp: int, seed: int = 0, fp8: bool = False
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    backend, block_size = make_backend(backend_name, "cpu")
    assert isinstance(backend, LSEAttentionBackend)
    scale = D**-0.5
    full_k = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
    full_v = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], HQ, D, generator=gen)
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v, strict=True)])
    outs, lses, caches, all_tables = [], [], [], []
    for rank in range(dcp):
        free = list(range(NUM_BLOCKS))
        rng.shuffle(free)
        cache = stored(torch.randn(2, NUM_BLOCKS, block_size, HKV, D, generator=gen), fp8)
        tables, slots = [], []
        for b, (cached, new) in enumerate(seqs):
            num_local = len(range(rank, cached + new, dcp))
            table = [free.pop() for _ in range(max(1, -(-num_local // block_size)))]
            tables.append(table)
            for t in range(cached + new):
                if t % dcp != rank:
                    if t >= cached:
                        slots.append(-1)
                    continue
                j = t // dcp
                slot = table[j // block_size] * block_size + j % block_size
                if t < cached:  # the cached prefix of the stripe is already here
                    flat = cache.view(2, -1, HKV, cache.shape[-1])
                    flat[0, slot] = stored(full_k[b][t], fp8)
                    flat[1, slot] = stored(full_v[b][t], fp8)
                else:
                    slots.append(slot)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=qsl,
            seq_lens=[c + n for c, n in seqs],
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            dcp_size=dcp,
            dcp_rank=rank,
        )
        for _ in range(2):  # a second layer reuses the step plan
            out, lse = backend.forward_with_lse(q, new_k, new_v, cache, meta, scale)
        outs.append(out)
        lses.append(lse)
        caches.append(cache)
        all_tables.append(tables)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    lse_all = torch.logsumexp(torch.stack(lses).double(), dim=0)
    for b, _ in enumerate(seqs):
        k_b, v_b = seen(full_k[b], fp8), seen(full_v[b], fp8)
        want, want_lse = _dense(q[qsl[b] : qsl[b + 1]], k_b, v_b, scale)
        got = merged[qsl[b] : qsl[b + 1]].double()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse_all[qsl[b] : qsl[b + 1]], want_lse, atol=2e-5, rtol=1e-5)
        for t in range(len(full_k[b])):  # every token sits only in its rank's stripe
            rank, j = t % dcp, t // dcp
            table = all_tables[rank][b]
            blk, off = table[j // block_size], j % block_size
            assert torch.equal(caches[rank][0, blk, off], stored(full_k[b][t], fp8))
            assert torch.equal(caches[rank][1, blk, off], stored(full_v[b][t], fp8))


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("backend_name", _lse_backends())
def test_striped_partials_merge_to_dense_attention(backend_name: str, dcp: int) -> None:
    # decodes, prefills behind a prefix, a 1-token sequence (ranks > 0 hold none of it)
    seqs = [(8, 1), (5, 7), (0, 1), (0, 6), (8, 3), (16, 1), (2, 1)]
    _run(backend_name, seqs, dcp)


@pytest.mark.parametrize("dcp", [1, 2, 3])
@pytest.mark.parametrize("backend_name", _lse_backends())
def test_fp8_stripes_merge_over_dequantized_values(backend_name: str, dcp: int) -> None:
    seqs = [(8, 1), (5, 7), (0, 1), (0, 6), (8, 3), (16, 1), (2, 1)]
    _run(backend_name, seqs, dcp, fp8=True)


@pytest.mark.parametrize("dcp", [2, 3])
@pytest.mark.parametrize("backend_name", _lse_backends())
def test_random_batches(backend_name: str, dcp: int) -> None:
    rng = random.Random(dcp)
    for seed in range(3):
        seqs = [(rng.randint(0, 20), rng.choice([1, 1, rng.randint(1, 9)])) for _ in range(5)]
        _run(backend_name, seqs, dcp, seed)


def test_merge_ignores_parts_without_keys() -> None:
    out = torch.randn(1, 3, 2, 4)
    lse = torch.randn(1, 3, 2)
    outs = torch.cat([out, torch.zeros(1, 3, 2, 4)])
    lses = torch.cat([lse, torch.full((1, 3, 2), float("-inf"))])
    torch.testing.assert_close(merge_partials(outs, lses), out[0])

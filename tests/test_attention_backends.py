"""Conformance suite of the AttentionBackend interface, run against every registered backend:
outputs against a naive dense attention over the full K/V, and the paged cache contents
after the write; with an fp8_e4m3 cache (uint8 rows with scales), the cache holds each
row quantized and attention equals the dense one over the dequantized K/V."""

from __future__ import annotations

import random

import pytest
import torch
from flex_simulator import simulate_flex

from engine.attention.base import _BACKENDS, AttentionBackend, AttentionMetadata, get_backend
from engine.attention.flex import FlexAttentionBackend
from engine.attention.kv_quant import dequantize, quantize
from engine.rope import RotaryEmbedding, apply_rotary
from modelinfo.config import RopeScaling

HQ, HKV, D = 6, 2, 16
NUM_BLOCKS = 200
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _backend_names() -> list[str]:
    get_backend("torch")  # registers the built-in backends
    return sorted(_BACKENDS)


def make_backend(name: str, device: str) -> tuple[AttentionBackend, int]:
    """The backend and the block size to test it with: "flex" tiles KV by whole blocks
    (>= 16 slots) and runs its compiled kernel on CUDA only, so on CPU it runs with the
    kernel simulator (tests/flex_simulator.py); the torch backends use 4-slot blocks."""
    if name == "flex":
        return FlexAttentionBackend(None if device == "cuda" else simulate_flex), 16
    return get_backend(name), 4


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [q_len, Hq, D] for the last q_len of seq_len positions; k, v [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.double().repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]: head h reads h // G
    v = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, q_len, S]
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [q_len, Hq, D]


def stored(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """What a cache holds for rows x: themselves, or their fp8 rows with scales."""
    return quantize(x) if fp8 else x


def seen(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The values attention reads back for rows x."""
    return dequantize(quantize(x), x.dtype) if fp8 else x


def _run_step(
    backend_name: str,
    device: str,
    seqs: list[tuple[int, int]],
    num_layers: int = 2,
    fp8: bool = False,
    rotating: bool = False,
):
    """seqs: (cached_len, new_len) per sequence, in batch order. Runs `num_layers` layers
    sharing one metadata (so backends exercise their per-step state) and checks both.
    `rotating`: through forward_rotating, q and the new k unrotated (views of one
    projection output, as the layer gives them), the checks against their rotation."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    backend, block_size = make_backend(backend_name, device)
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous, out-of-order blocks
    tables, slot_mapping, qsl, seq_lens = [], [], [0], []
    for cached, new in seqs:
        seq_len = cached + new
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        slot_mapping += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, seq_len)
        ]
        qsl.append(qsl[-1] + new)
        seq_lens.append(seq_len)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, device=device),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
    )
    scale = D**-0.5
    for _ in range(num_layers):
        garbage = torch.randn(2, NUM_BLOCKS, block_size, HKV, D, generator=gen)
        cache = stored(garbage, fp8)
        full_k = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
        full_v = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
        for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v, strict=True):
            for p in range(cached):  # the cached prefix is already in the paged cache
                cache[0, table[p // block_size], p % block_size] = stored(k[p], fp8)
                cache[1, table[p // block_size], p % block_size] = stored(v[p], fp8)
        q = torch.randn(qsl[-1], HQ, D, generator=gen)
        new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k, strict=True)])
        new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v, strict=True)])
        cache = cache.to(device)
        if rotating:
            positions = torch.tensor([p for c, n in seqs for p in range(c, c + n)])
            cos, sin = RotaryEmbedding(D, 10000.0, RopeScaling(), torch.device("cpu")).cos_sin(
                positions, torch.float32
            )
            qkv = torch.cat([q.flatten(1), new_k.flatten(1), new_v.flatten(1)], 1).to(device)
            views = qkv.split([HQ * D, HKV * D, HKV * D], 1)
            q_in, k_in, v_in = (t.view(qsl[-1], -1, D) for t in views)
            out = backend.forward_rotating(
                q_in, k_in, v_in, cos.to(device), sin.to(device), cache, meta, scale
            ).cpu()
            q, rotated = apply_rotary(q, cos, sin), apply_rotary(new_k, cos, sin)
            at = 0
            for b, (c, n) in enumerate(seqs):
                full_k[b][c:] = rotated[at : at + n]
                at += n
        else:
            out = backend.forward(
                q.to(device), new_k.to(device), new_v.to(device), cache, meta, scale
            ).cpu()
        cache = cache.cpu()
        assert out.shape == (qsl[-1], HQ, D)
        for b, ((cached, new), table) in enumerate(zip(seqs, tables, strict=True)):
            k_b, v_b = seen(full_k[b], fp8), seen(full_v[b], fp8)
            want = _dense_reference(q[qsl[b] : qsl[b + 1]], k_b, v_b, scale)
            torch.testing.assert_close(
                out[qsl[b] : qsl[b + 1]].double(), want, atol=2e-5, rtol=1e-5
            )
            for p in range(cached + new):  # every position, old and new, sits at its slot
                blk, off = table[p // block_size], p % block_size
                if rotating:  # a kernel's float32 rotation may round differently (FMA)
                    torch.testing.assert_close(cache[0, blk, off], full_k[b][p])
                else:
                    assert torch.equal(cache[0, blk, off], stored(full_k[b][p], fp8))
                assert torch.equal(cache[1, blk, off], stored(full_v[b][p], fp8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_mixed_batch_prefills_with_prefix_and_decodes(backend_name: str, device: str) -> None:
    # decode, prefill behind a cached prefix, decode of a 1-token sequence, fresh prefill,
    # prefill with a block-aligned prefix, decode across many blocks
    seqs = [(8, 1), (5, 7), (0, 1), (0, 6), (8, 3), (16, 1)]
    _run_step(backend_name, device, seqs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_pure_decode_batch(backend_name: str, device: str) -> None:
    _run_step(backend_name, device, [(3, 1), (12, 1), (7, 1), (20, 1)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_forward_rotating_equals_forward_of_rotated(backend_name: str, device: str) -> None:
    """forward_rotating (q, k unrotated: the layer's call where the backend rotates on
    write, flex_kv_write.rope_write under the flex backend on CUDA) against the dense
    attention of the rotated q, k: a pure-decode step, and a mixed one (the default
    path: rotation first, then forward)."""
    _run_step(backend_name, device, [(3, 1), (12, 1), (7, 1), (20, 1)], rotating=True)
    _run_step(backend_name, device, [(8, 1), (5, 7), (0, 1)], rotating=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_single_prefills(backend_name: str, device: str) -> None:
    _run_step(backend_name, device, [(0, 13)])
    _run_step(backend_name, device, [(9, 2)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_long_prefills_span_query_tiles(backend_name: str, device: str) -> None:
    # 300 new tokens behind an unaligned 203-token prefix (query tiles of 128 straddle
    # blocks), a decode, and a fresh 129-token prompt (a one-row last tile)
    _run_step(backend_name, device, [(203, 300), (37, 1), (0, 129)], num_layers=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", _backend_names())
def test_fp8_cache_quantizes_on_write_and_reads_dequantized(backend_name: str, device: str) -> None:
    seqs = [(8, 1), (5, 7), (0, 1), (0, 6), (8, 3), (16, 1)]
    _run_step(backend_name, device, seqs, fp8=True)
    _run_step(backend_name, device, [(3, 1), (12, 1), (7, 1), (20, 1)], fp8=True)


@pytest.mark.parametrize("device", DEVICES)
def test_flex_decode_lse_only_where_asked(device: str) -> None:
    """A pure-decode step of the flex backend: `forward` (which does not ask its kernel
    for the LSE) and `forward_with_lse` give the same output, and the LSE is the dense
    one's log-sum-exp of the scaled scores."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    backend, bs = make_backend("flex", device)
    gen = torch.Generator().manual_seed(3)
    lens = [37, 16, 70]
    tables = [[i * 5 + j for j in range(-(-n // bs))] for i, n in enumerate(lens)]
    width = max(len(t) for t in tables)
    cache = torch.randn(2, NUM_BLOCKS, bs, HKV, D, generator=gen)
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    q = torch.randn(len(lens), HQ, D, generator=gen)
    k_new, v_new = torch.randn(2, len(lens), HKV, D, generator=gen)
    scale = D**-0.5
    outs = []
    for with_lse in (False, True):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=list(range(len(lens) + 1)),
            seq_lens=lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        )
        args = (q.to(device), k_new.to(device), v_new.to(device), cache.to(device), meta, scale)
        if with_lse:
            out, lse = backend.forward_with_lse(*args)
        else:
            out = backend.forward(*args)
        outs.append(out.cpu())
    torch.testing.assert_close(outs[0], outs[1])
    flat = cache.view(2, -1, HKV, D)
    for b, (n, table) in enumerate(zip(lens, tables, strict=True)):
        idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        k = flat[0, idx].clone()
        k[-1] = k_new[b]
        k = k.double().repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        torch.testing.assert_close(
            lse[b].cpu().double(), scores.logsumexp(-1), atol=2e-4, rtol=1e-4
        )

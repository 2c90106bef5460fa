"""The "cpu" attention backend (in-place paged decode and prefill kernels) against the
"torch" reference on random paged layouts: the model's shapes (head dim 64, GQA 3) and
others, bfloat16 and float32, block sizes 4, 16 and 7, decode rows alone, prefill chunks
(1..512 new tokens behind 0..several K cached ones) alone and mixed with decode rows, one
thread and several; the kernels' LSE and the decode kernel's keyless rows; fp8 caches on
the reference path. (The shared conformance suite, tests/test_attention_backends.py,
runs it too.)"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import cpu_kernel
from engine.attention.base import AttentionMetadata, get_backend
from engine.attention.cpu_paged import CpuPagedAttentionBackend
from engine.attention.kv_quant import quantize


def _layout(
    seqs: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Metadata for (cached, new) per sequence over shuffled blocks; int32 block tables
    as the model runner keeps them (wider than needed, as after a longer step)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, qsl, lens = [], [], [0], []
    for cached, new in seqs:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, n)]
        qsl.append(qsl[-1] + new)
        lens.append(n)
    width = max(len(t) for t in tables) + 3
    bt = torch.tensor([t + [rng.randrange(num_blocks)] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=bt.to(torch.int32),
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int32),
    )
    return meta, tables


def _both(
    seqs: list[tuple[int, int]],
    *,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    seed: int = 0,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cpu out, torch out, cpu cache after, torch cache after) for one layer."""
    num_blocks = max(300, sum(-(-(c + n) // block_size) for c, n in seqs) + 20)
    meta, _ = _layout(seqs, block_size, num_blocks, seed)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = meta.query_start_loc[-1]
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    if fp8:
        cache = quantize(cache)
    q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    scale = d**-0.5
    outs, caches = [], []
    for name in ("cpu", "torch"):
        c = cache.clone()
        m = AttentionMetadata(**{f: getattr(meta, f) for f in meta.__dataclass_fields__})
        m.backend_state = {}
        outs.append(get_backend(name).forward(q, k, v, c, m, scale))
        caches.append(c)
    return outs[0], outs[1], caches[0], caches[1]


TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}

MIXED = [(37, 1), (0, 9), (100, 1), (5, 6), (1, 1), (64, 1)]
DECODE = [(0, 1), (15, 1), (16, 1), (200, 1), (333, 1)]


def test_the_kernel_builds_here() -> None:
    # CI installs a C compiler (scripts/setup.sh): there the kernel must be in use, not
    # silently replaced by the reference.
    assert cpu_kernel.available()
    assert CpuPagedAttentionBackend().kernel


def test_loading_the_kernel_keeps_subnormals() -> None:
    """The library must not switch the process to flush-to-zero when it is loaded (what a
    -ffast-math build's crtfastmath.o does): the engine's float32 math and everything else
    in the process would then round subnormals to 0."""
    cpu_kernel.load()
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert (torch.tensor(1e-40, dtype=torch.float32) * 2).item() > 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 24)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_matches_reference_on_random_paged_layouts(
    dtype: torch.dtype, hq: int, hkv: int, d: int, block_size: int, seqs: list
) -> None:
    ours, ref, ours_cache, ref_cache = _both(
        seqs, dtype=dtype, hq=hq, hkv=hkv, d=d, block_size=block_size
    )
    assert ours.dtype == dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    assert torch.equal(ours_cache, ref_cache)  # the same writes, and only those


PREFILL = {
    "cold-512": [(0, 512)],
    "256-behind-3K": [(3000, 256)],
    "short-chunks": [(0, 2), (1, 3), (4100, 2), (16, 17), (5, 1)],
    "mixed": [(2500, 1), (700, 300), (0, 1), (0, 45), (1200, 1), (6, 33)],
}
"""(cached, new) per sequence: a cold chunk of 512, a chunk behind a long prefix, chunks
of 2..17 tokens (fewer rows than a kernel unit) behind 0..4K, and decode rows interleaved
with chunks (the unified engine's mixed steps)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 24), (10, 2, 20), (4, 2, 15)],
)
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("seqs", list(PREFILL.values()), ids=list(PREFILL))
def test_prefill_rows_match_reference(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    seqs: list,
) -> None:
    """Odd head dims take the kernel's float32 path for bf16 keys too (its bf16 dot
    product takes dims in pairs)."""
    calls = []
    kernel = cpu_kernel.prefill
    monkeypatch.setattr(cpu_kernel, "prefill", lambda *a: calls.append(1) or kernel(*a))
    ours, ref, ours_cache, ref_cache = _both(
        seqs, dtype=dtype, hq=hq, hkv=hkv, d=d, block_size=block_size, seed=len(seqs)
    )
    assert calls, "prefill rows went to the reference path, not the kernel"
    assert ours.dtype == dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    assert torch.equal(ours_cache, ref_cache)


@pytest.mark.parametrize("threads", [1, 4])
def test_prefill_kernel_lse_and_only_its_rows(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Against attention in float64 over the keys each new token sees (lower-right
    causal): out and lse = log sum exp(scale q k); rows of sequences not listed (here a
    decode row) stay as they were; 4 threads deal the units out in turn."""
    monkeypatch.setattr(cpu_kernel, "MIN_PREFILL_WORK_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    meta, tables = _layout([(40, 1), (20, 13), (0, 5), (90, 40)], 16, 80, 2)
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 80, 16, 2, 64, generator=gen)
    q = torch.randn(59, 6, 64, generator=gen)
    seqs = torch.tensor([[1, 13, 33, 1], [14, 5, 5, 2], [19, 40, 130, 3]], dtype=torch.int32)
    out, lse = torch.full((59, 6, 64), 7.0), torch.full((59, 6), 7.0)
    cpu_kernel.prefill(q, cache, meta.block_tables, seqs, 0.125, out, lse)
    assert (out[0] == 7.0).all() and (lse[0] == 7.0).all()
    for first, q_len, seq_len, b in seqs.tolist():
        slots = [tables[b][p // 16] * 16 + p % 16 for p in range(seq_len)]
        k = cache[0].reshape(-1, 2, 64)[slots].repeat_interleave(3, dim=1).double()
        v = cache[1].reshape(-1, 2, 64)[slots].repeat_interleave(3, dim=1).double()
        for j in range(q_len):
            n = seq_len - q_len + j + 1  # keys this token sees
            s = torch.einsum("hd,nhd->hn", q[first + j].double(), k[:n]) * 0.125
            want = torch.einsum("hn,nhd->hd", s.softmax(-1), v[:n])
            torch.testing.assert_close(out[first + j].double(), want, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(
                lse[first + j].double(), s.logsumexp(-1), atol=2e-6, rtol=1e-6
            )


@pytest.mark.parametrize(
    "seqs",
    [
        DECODE,
        [(700, 1)],
        [(300, 1), (45, 1)],
        [(300, 40), (0, 9), (45, 1)],
        [(500, 300), (3, 1)],
    ],
    ids=["by-seq", "by-keys", "both", "prefill-units", "prefill-batches"],
)
def test_several_threads_split_the_step(monkeypatch: pytest.MonkeyPatch, seqs: list) -> None:
    """3 threads: 5 sequences split by sequence; 1 or 2 sequences have their keys cut into
    block-aligned parts merged by LSE; prefill chunks' units dealt out in turn (300 new
    tokens x 3 query heads of a KV head: 29 units, ~10 a job, run in batches of up to 8)."""
    monkeypatch.setattr(cpu_kernel, "MIN_KEYS_PER_THREAD", 1)
    monkeypatch.setattr(cpu_kernel, "MIN_PREFILL_WORK_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            ours, ref, _, _ = _both(seqs, dtype=dtype, hq=9, hkv=3, d=64, block_size=16)
            torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 6])
def test_kernel_lse_and_rows_without_keys(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """lse = log sum exp(scale q k) over the keys; a sequence of 0 keys (a DCP rank
    holding none of its tokens) gets out 0 and lse -inf, also when 6 threads cut the
    keys into 2 parts (parts without keys merge away)."""
    monkeypatch.setattr(cpu_kernel, "MIN_KEYS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    meta, tables = _layout([(40, 1), (0, 1), (7, 1)], 16, 50, 1)
    lens = torch.tensor([41, 0, 8], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 50, 16, 2, 64, generator=gen)
    q = torch.randn(3, 6, 64, generator=gen)
    out, lse = cpu_kernel.decode(q, cache, meta.block_tables, lens, 41, 0.125)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            assert torch.equal(out[b], torch.zeros(6, 64))
            assert torch.isneginf(lse[b]).all()
            continue
        slots = [tables[b][p // 16] * 16 + p % 16 for p in range(n)]
        k = cache[0].reshape(-1, 2, 64)[slots].repeat_interleave(3, dim=1)  # [n, 6, 64]
        v = cache[1].reshape(-1, 2, 64)[slots].repeat_interleave(3, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k.double()) * 0.125
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), v.double())
        torch.testing.assert_close(out[b].double(), want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), s.logsumexp(-1), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (20, 2, 32, 7), (6, 6, 96, 4), (9, 3, 64, 5)],
)
def test_bf16_decode_against_float64(hq: int, hkv: int, d: int, block_size: int) -> None:
    """The bf16 decode kernel (one pass over tiles of 16 keys with AVX-512, the portable
    kernel elsewhere) against float64 attention over the same bf16 values: float32
    accumulation leaves it within ~1e-6 (the bf16 rounding of the output is the caller's).
    Lengths around the tile of 16 (partial tiles, one key), blocks of 4-16 tokens that a
    tile crosses, GQA groups of 1-10 (more than 8 query heads per KV head are scored in
    two chunks), head dims 32-128."""
    lens_list = [1, 15, 16, 17, 40, 333, 1000]
    meta, tables = _layout([(n - 1, 1) for n in lens_list], block_size, 700, 3)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 700, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(lens_list), hq, d, generator=gen) * 2  # sharper softmax
    out, lse = cpu_kernel.decode(q, cache, meta.block_tables, lens, max(lens_list), d**-0.5)
    for b, n in enumerate(lens_list):
        slots = [tables[b][p // block_size] * block_size + p % block_size for p in range(n)]
        k = cache[0].reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        v = cache[1].reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * d**-0.5
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
        torch.testing.assert_close(out[b].double(), want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), s.logsumexp(-1), atol=2e-6, rtol=1e-6)


def test_fp8_cache_runs_the_reference_path() -> None:
    ours, ref, ours_cache, ref_cache = _both(
        MIXED, dtype=torch.float32, hq=9, hkv=3, d=64, block_size=16, fp8=True
    )
    assert torch.equal(ours, ref)
    assert torch.equal(ours_cache, ref_cache)

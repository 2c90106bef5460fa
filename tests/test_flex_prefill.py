"""Long prefill rows of the flex backend (engine/attention/flex_prefill.py): the shape
buckets, the split into a maskless bulk part and a causal square merged by LSE, against
dense attention over the full K/V. On CPU the dense kernel is float32 math (the split,
padding and merge logic is what runs); under -m gpu, cuDNN's on bf16 in mixed batches
with a long prefix, against the torch reference backend."""

from __future__ import annotations

import random

import pytest
import torch
from flex_simulator import simulate_flex

from engine.attention import flex_prefill
from engine.attention.base import AttentionMetadata, get_backend
from engine.attention.flex import FlexAttentionBackend


def test_buckets_are_few_and_tight() -> None:
    for n in range(1, 40000, 7):
        b = flex_prefill.bucket(n)
        assert n <= b <= n + max(63, n // 8)
    assert len({flex_prefill.bucket(n) for n in range(4097, 8193)}) == 8
    assert flex_prefill.bucket(8192) == 8192


@pytest.mark.parametrize(
    "prefix,new", [(0, 8192), (1000, 300), (2048, 512), (57344, 8192), (60001, 1), (4097, 9000)]
)
def test_plan_covers_the_prefix(prefix: int, new: int) -> None:
    s = flex_prefill.plan(prefix, new)
    assert s.bulk % flex_prefill.KV_GRAIN == 0 and 0 <= s.tail < flex_prefill.KV_GRAIN
    assert s.bulk + s.tail == prefix
    assert s.rows == flex_prefill.bucket(new) >= new
    assert s.square == flex_prefill.bucket(s.tail + new) >= s.tail + new


def test_wanted_threshold() -> None:
    assert flex_prefill.wanted(0, 8192) and flex_prefill.wanted(57344, 512)
    assert not flex_prefill.wanted(2048, 512) and not flex_prefill.wanted(100_000, 16)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last q_len of k's positions; GQA by head groups."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(seq_len, device=q.device)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def _step(
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A step of sequences (cached, new) over a paged cache of shuffled 16-token blocks
    holding each prefix: (meta, q, each sequence's full k and v, the cache)."""
    block_size = 16
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // block_size) for c, n in seqs)
    free = list(range(need + 4))
    random.Random(seed).shuffle(free)
    cache = torch.randn(2, need + 4, block_size, hkv, d, generator=gen).to(dtype)
    tables, slots, qsl, lens, ks, vs = [], [], [0], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        k = torch.randn(cached + new, hkv, d, generator=gen).to(dtype)
        v = torch.randn(cached + new, hkv, d, generator=gen).to(dtype)
        for p in range(cached):
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + new)
        ]
        tables.append(table)
        qsl.append(qsl[-1] + new)
        lens.append(cached + new)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
    )
    q = torch.randn(qsl[-1], hq, d, generator=gen).to(dtype)
    return (
        meta,
        q.to(device),
        [k.to(device) for k in ks],
        [v.to(device) for v in vs],
        cache.to(device),
    )


def _new(seqs: list[tuple[int, int]], full: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x[c:] for (c, _), x in zip(seqs, full, strict=True)])


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 50)],  # no prefix: the causal square alone
        [(20, 40)],  # a tail, no bulk part
        [(64, 5)],  # a bulk part, no tail
        [(100, 37)],  # bulk + tail, the prefix ending inside a block
        [(8, 1), (100, 37), (0, 1), (0, 50), (40, 1), (33, 20)],  # mixed with decode rows
    ],
)
def test_long_rows_equal_dense_attention_cpu(
    seqs: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flex_prefill, "KV_GRAIN", 32)  # bulk and tail at small sizes
    calls = []

    def dense(*args: object) -> object:
        calls.append(args[3])
        return flex_prefill.math_dense(*args)  # type: ignore[arg-type]

    backend = FlexAttentionBackend(simulate_flex, dense=dense)
    backend.long_prefill_pairs = 0
    meta, q, ks, vs, cache = _step(seqs, 6, 2, 16, torch.float32, "cpu")
    scale = 16**-0.5
    out = backend.forward(q, _new(seqs, ks), _new(seqs, vs), cache, meta, scale)
    for b in range(len(seqs)):
        want = _dense(q[meta.query_start_loc[b] : meta.query_start_loc[b + 1]], ks[b], vs[b], scale)
        got = out[meta.query_start_loc[b] : meta.query_start_loc[b + 1]].double()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    long_rows = [(c, n) for c, n in seqs if n > 1]
    assert calls.count(True) == len(long_rows)  # one causal square per long row
    assert calls.count(False) == sum(c >= 32 for c, _ in long_rows)  # bulk parts


# -- CUDA: cuDNN's kernel --------------------------------------------------------------
@pytest.mark.gpu
def test_cudnn_long_rows_in_a_mixed_batch_match_the_reference() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # decode rows, a long row behind a 5000-token prefix (bulk + tail), a long row with no
    # prefix, a short row behind a prefix (the flash path), all in one step
    seqs = [(3000, 1), (5000, 3000), (0, 4096), (100, 1), (2100, 700)]
    meta, q, ks, vs, cache = _step(seqs, 16, 4, 128, torch.bfloat16, "cuda")
    ref_cache = cache.clone()
    flex = FlexAttentionBackend()
    assert flex_prefill.usable(q, cache)
    used = []
    cudnn = flex_prefill.cudnn_dense

    def spy(*args: object) -> object:
        used.append(args[3])
        return cudnn(*args)  # type: ignore[arg-type]

    scale = 128**-0.5
    k_new, v_new = _new(seqs, ks), _new(seqs, vs)
    mp = pytest.MonkeyPatch()
    mp.setattr(flex_prefill, "cudnn_dense", spy)
    try:
        out = flex.forward(q, k_new, v_new, cache, meta, scale)
    finally:
        mp.undo()
    assert used.count(True) == 2 and used.count(False) == 1  # (5000, 3000) and (0, 4096)
    ref = get_backend("torch").forward(q, k_new, v_new, ref_cache, meta, scale)
    assert torch.equal(cache, ref_cache)  # the same K/V written at the same slots
    for b in range(len(seqs)):
        rows = slice(meta.query_start_loc[b], meta.query_start_loc[b + 1])
        want = _dense(q[rows].float(), ks[b].float(), vs[b].float(), scale).float()
        err = ((out[rows].float() - want).norm() / want.norm()).item()
        ref_err = ((ref[rows].float() - want).norm() / want.norm()).item()
        assert err < 1e-2 and err <= 2 * ref_err + 2e-3, (seqs[b], err, ref_err)


@pytest.mark.gpu
def test_merge_kernel_equals_torch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    h, d = 8, 128
    o_a = torch.randn(300, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    o_b = torch.randn(350, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lse_a = torch.randn(h, 300, device="cuda", generator=g) * 4
    lse_b = torch.randn(h, 350, device="cuda", generator=g) * 4
    got = flex_prefill.merge(o_a, lse_a, 0, o_b, lse_b, 37, 250)
    want = flex_prefill.merge(o_a.cpu(), lse_a.cpu(), 0, o_b.cpu(), lse_b.cpu(), 37, 250)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)

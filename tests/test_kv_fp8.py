"""The fp8_e4m3 KV cache format: rows quantized with their own scale, the layout's bytes
(about half of bfloat16: twice the tokens in the same memory), the option in EngineConfig
and cluster.yaml (validated, shown by `kvserve check`), and its own KV namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import yaml

from engine.attention.kv_quant import FP8_MAX, dequantize, quantize
from engine.config import EngineConfig
from protocol.cluster import parse_cluster
from protocol.config_errors import ConfigError
from protocol.kv_layout import KVLayout

REPO = Path(__file__).resolve().parent.parent
FP8 = "fp8_e4m3"
LOCAL = REPO / "deploy" / "examples" / "local-pd.yaml"


def test_rows_carry_their_scale_and_round_trip_within_fp8_precision() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero row
    rows = quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32).squeeze(-1)
    amax = x.abs().amax(-1)
    assert torch.equal(scale[amax > 0], amax[amax > 0] * (1.0 / FP8_MAX))
    assert scale[7, 1] == 1.0
    back = dequantize(rows, torch.float32)
    assert torch.equal(back[7, 1], torch.zeros(64))
    # e4m3 keeps 3 mantissa bits: half an ulp is at most 1/16 of a normal value (and half
    # the smallest subnormal, 2^-10 x scale, below them); the row's largest value maps to
    # 448 and back
    err = (back - x).abs()
    bound = x.abs() / 16 + (amax / FP8_MAX * 2**-10).unsqueeze(-1)
    assert bool((err <= bound * (1 + 1e-6)).all())
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0)
    # a row's bytes depend on that row only (what lets prefix cache, pool and handoff
    # move rows without re-quantizing)
    assert torch.equal(quantize(x[10:20]), rows[10:20])
    assert torch.equal(quantize(x.to(torch.bfloat16)), quantize(x.to(torch.bfloat16)))


def test_layout_bytes_halve_bfloat16() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64
    bf16 = KVLayout(30, 3, 64, 16, "bfloat16")
    fp8 = KVLayout(30, 3, 64, 16, "bfloat16", cache_dtype="fp8_e4m3")
    assert bf16.bytes_per_token_per_layer == 2 * 3 * 64 * 2 == 768
    assert fp8.bytes_per_token_per_layer == 2 * 3 * (64 + 4) == 408
    assert fp8.storage_dtype == "uint8" and fp8.row_width == 68 and fp8.row_bytes == 68
    assert bf16.storage_dtype == "bfloat16" and bf16.row_width == 64
    assert fp8.cache_shape(10) == (2, 10, 16, 3, 68)
    budget = 512 * 1024**2
    assert budget // fp8.bytes_per_block >= 1.8 * (budget // bf16.bytes_per_block)
    # head_dim 128: 132 / 256 bytes per row
    assert KVLayout(1, 1, 128, 16, "bfloat16", cache_dtype="fp8_e4m3").row_bytes == 132
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        KVLayout(1, 1, 64, 16, "bfloat16", cache_dtype="fp8")
    # the layout crosses processes (LandingInfo): the field survives msgpack
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(fp8), type=KVLayout) == fp8


def test_engine_config_validates_the_option() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_cluster_option_and_its_error() -> None:
    data = yaml.safe_load(LOCAL.read_text())
    assert parse_cluster(data).kv_cache_dtype == "auto"
    data["kv_cache_dtype"] = "fp8_e4m3"
    assert parse_cluster(data).kv_cache_dtype == "fp8_e4m3"
    data["kv_cache_dtype"] = "fp8"
    with pytest.raises(ConfigError) as e:
        parse_cluster(data)
    assert "kv_cache_dtype" in str(e.value) and "fp8_e4m3" in str(e.value)


def test_check_shows_the_fp8_budget(tmp_path: Path) -> None:
    """`kvserve check` counts the KV bytes of a token in the cluster's KV cache dtype: with
    the same kv_cache_memory an fp8 cluster holds about twice the tokens of bfloat16."""

    def check(kv: str, gpus: bool = False) -> str:
        data = yaml.safe_load(LOCAL.read_text())
        data["dtype"] = "bfloat16"
        data["kv_cache_dtype"] = kv
        if gpus:
            data["prefill"][0]["devices"] = [0]
            data["decode"][0]["devices"] = [1]
        path = tmp_path / f"{kv}.yaml"
        path.write_text(yaml.safe_dump(data))
        res = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "check", "-c", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    def tokens(out: str, name: str) -> int:
        line = next(x for x in out.splitlines() if x.strip().startswith(f"kv cache {name}:"))
        return int(line.split("holds ")[1].split()[0])

    bf16, fp8 = check("auto"), check("fp8_e4m3")
    assert "KV cache fp8_e4m3" in fp8 and "KV cache" not in bf16.splitlines()[1]
    assert "kv cache prefill-0: fp8_e4m3, 12240 bytes per token per stage" in fp8
    assert "kv cache prefill-0: bfloat16, 23040 bytes per token per stage" in bf16
    for name in ("prefill-0", "decode-0"):
        assert tokens(fp8, name) >= 1.8 * tokens(bf16, name)
    # on GPUs, check says that fp8 rows are read by the reference attention
    assert "kv cache note" not in fp8
    assert "kv cache note: on GPUs fp8_e4m3 rows are read by the reference" in check(FP8, True)
    assert "kv cache note" not in check("auto", True)


def test_mla_latent_rows() -> None:
    """DeepSeek-V2-Lite's latent (512 + 64) as an fp8 row: 580 bytes per token per layer
    (the 576 fp8 values and their scale) against 1,152 in bfloat16; attention over an fp8
    latent cache equals attention over the dequantized latent."""
    layout = KVLayout(27, 1, 576, 16, "bfloat16", kind="mla", cache_dtype="fp8_e4m3")
    assert layout.bytes_per_token_per_layer == 580
    assert layout.cache_shape(3) == (1, 3, 16, 1, 580)
    from engine.attention.base import AttentionMetadata, get_backend

    g = torch.Generator().manual_seed(1)
    c, dv, bs, heads = 40, 24, 4, 4
    seqs = [(0, 9), (6, 1), (3, 5)]  # (cached, new): a prefill, a decode, a prefix hit
    lat = [torch.randn(a + n, 1, c, generator=g) for a, n in seqs]
    q = torch.randn(sum(n for _, n in seqs), heads, c, generator=g)
    tables = [[3 * b, 3 * b + 1, 3 * b + 2] for b in range(len(seqs))]
    slots, qsl = [], [0]
    for (a, n), t in zip(seqs, tables, strict=True):
        slots += [t[p // bs] * bs + p % bs for p in range(a, a + n)]
        qsl.append(qsl[-1] + n)
    for name in ("torch", "torch_lse"):
        outs = []
        for fp8 in (True, False):
            backend = get_backend(name)
            cache = torch.zeros(1, 10, bs, 1, c + 4 * fp8)
            cache = cache.to(torch.uint8) if fp8 else cache
            flat = cache.view(-1, 1, cache.shape[-1])
            for (a, _), t, x in zip(seqs, tables, lat, strict=True):
                for p in range(a):  # the cached prefix
                    row = x[p] if fp8 else dequantize(quantize(x[p]), torch.float32)
                    flat[t[p // bs] * bs + p % bs] = quantize(row) if fp8 else row
            new = torch.cat([x[a:] for (a, _), x in zip(seqs, lat, strict=True)])
            if not fp8:
                new = dequantize(quantize(new), torch.float32)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots),
                query_start_loc=qsl,
                seq_lens=[a + n for a, n in seqs],
                block_tables=torch.tensor(tables),
            )
            outs.append(backend.forward_mla(q, new, cache, meta, c**-0.5, dv))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        # and the fp8 cache is not a no-op: the raw latent gives other values
        assert not torch.allclose(outs[0], _mla_raw(name, q, lat, seqs, tables, qsl, slots, dv))


def _mla_raw(name, q, lat, seqs, tables, qsl, slots, dv):  # type: ignore[no-untyped-def]
    """forward_mla of the same step over a float32 cache of the unquantized latent."""
    from engine.attention.base import AttentionMetadata, get_backend

    bs, c = 4, lat[0].shape[-1]
    cache = torch.zeros(1, 10, bs, 1, c)
    flat = cache.view(-1, 1, c)
    for (a, _), t, x in zip(seqs, tables, lat, strict=True):
        for p in range(a):
            flat[t[p // bs] * bs + p % bs] = x[p]
    new = torch.cat([x[a:] for (a, _), x in zip(seqs, lat, strict=True)])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=[a + n for a, n in seqs],
        block_tables=torch.tensor(tables),
    )
    return get_backend(name).forward_mla(q, new, cache, meta, c**-0.5, dv)

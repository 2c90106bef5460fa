"""One layer's prefill attention over a long cached prefix, one GPU: the kernels a
Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head dim 128, bf16) can run for a
chunk of new tokens behind a paged cache, checked against float32 math, then timed.

    python benchmarks/gpu_engine_prefill_attn.py [--prefixes 0,2048,16384,57344]
        [--new 8192,512] [--flex]

The cache is paged (16-token blocks, drawn at random from a cache of twice the
sequence), filled with random values; the chunk's own K/V are in it already, as the
backend writes them before attending. Variants (each includes the gather of the blocks
it reads into contiguous K/V, since the engine has to do it too):

- flash_lr: what engine/attention/flex.py runs today: gather prefix + new, SDPA with a
  lower-right causal bias (FlashAttention-2 in torch);
- cudnn_one: gather prefix + new, cuDNN attention with is_causal (which diagonal it keeps
  when queries < keys is what the check shows);
- cudnn_split: gather the prefix only; cuDNN over the prefix (no mask) and cuDNN causal
  over the chunk's own k/v (square: both alignments agree), merged by their LSEs;
- flash_split: the same split through the flash kernel (its LSE);
- engine: engine/attention/flex_prefill.py, what the flex backend runs for long rows
  (cudnn_split with shapes bucketed and a Triton merge);
- flex (--flex): FlexAttention's compiled prefill kernel over the gathered K/V with a
  lower-right causal mask.

Checks: 512 query rows (the chunk's first and last 256) against float32 math over all
keys, relative error of the output and, where returned, max error of the LSE. Timing:
CUDA events, median of 5 after 2 warm-ups. cuDNN builds one execution plan per shape:
its first call on an unseen shape is timed too.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.attention import flex_prefill

HQ, HKV, D, BS = 32, 8, 128, 16
SCALE = 1 / math.sqrt(D)


def events_ms(fn: Any, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    return sorted(times)[reps // 2]


class Case:
    def __init__(self, prefix: int, new: int, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.prefix, self.new, self.seq = prefix, new, prefix + new
        n_blocks = -(-self.seq // BS)
        total = 2 * n_blocks + 8
        self.cache = torch.randn(
            2, total, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g
        )
        self.table = torch.randperm(total, device="cuda", generator=g)[:n_blocks]
        self.q = torch.randn(new, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.k = torch.randn(new, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(new, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        pos = torch.arange(prefix, self.seq, device="cuda")
        slots = self.table[pos // BS] * BS + pos % BS
        flat = self.cache.view(2, -1, HKV, D)
        flat[0].index_copy_(0, slots, self.k)
        flat[1].index_copy_(0, slots, self.v)

    def gather(self, n: int) -> torch.Tensor:  # [2, n, Hkv, D]
        blocks = self.table[: -(-n // BS)]
        kv = self.cache.view(2, self.cache.shape[1], -1).index_select(1, blocks)
        return kv.view(2, -1, HKV, D)[:, :n]

    def reference(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.gather(self.seq).float()
        k = kv[0].repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]
        v = kv[1].repeat_interleave(HQ // HKV, dim=1)
        q = self.q.index_select(0, rows).float()  # [R, Hq, D]
        s = torch.einsum("rhd,shd->hrs", q, k) * SCALE
        key = torch.arange(self.seq, device="cuda")
        mask = key[None, :] <= (self.prefix + rows)[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hq, R]
        o = torch.einsum("hrs,shd->rhd", torch.softmax(s, dim=-1), v)
        return o, lse.transpose(0, 1)


def bhsd(x: torch.Tensor) -> torch.Tensor:  # [S, H, D] -> [1, H, S, D] view
    return x.transpose(0, 1).unsqueeze(0)


def merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] bf16 + [T, H] float32 LSEs over disjoint keys -> exact whole."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    o = o1.float() * (w1 / s).unsqueeze(-1) + o2.float() * (w2 / s).unsqueeze(-1)
    return o.to(o1.dtype), m + torch.log(s)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: str) -> Any:
    """[S, H, D] views -> out [Sq, Hq, D], lse [Sq, Hq]."""
    if gqa == "expand":
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal, False, scale=SCALE
    )
    o, lse = res[0], res[1]
    return o[0].transpose(0, 1), lse.reshape(HQ, -1).transpose(0, 1)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False, scale=SCALE
    )
    return res[0][0].transpose(0, 1), res[1].reshape(HQ, -1).transpose(0, 1)


def variants(c: Case, gqa: str, use_flex: bool) -> dict[str, Any]:
    from torch.nn.attention.bias import causal_lower_right

    out: dict[str, Any] = {}

    def flash_lr() -> Any:
        if c.prefix == 0:
            o = F.scaled_dot_product_attention(
                bhsd(c.q), bhsd(c.k), bhsd(c.v), is_causal=True, scale=SCALE, enable_gqa=True
            )
            return o[0].transpose(0, 1), None
        kv = c.gather(c.seq)
        o = F.scaled_dot_product_attention(
            bhsd(c.q),
            bhsd(kv[0]),
            bhsd(kv[1]),
            attn_mask=causal_lower_right(c.new, c.seq),
            scale=SCALE,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1), None

    out["flash_lr"] = flash_lr

    def cudnn_one() -> Any:
        if c.prefix == 0:
            return cudnn(c.q, c.k, c.v, True, gqa)
        kv = c.gather(c.seq)
        return cudnn(c.q, kv[0], kv[1], True, gqa)

    out["cudnn_one"] = cudnn_one

    def split(kernel: Any) -> Any:
        def run() -> Any:
            o2, l2 = kernel(c.q, c.k, c.v, True)
            if c.prefix == 0:
                return o2, l2
            kv = c.gather(c.prefix)
            o1, l1 = kernel(c.q, kv[0], kv[1], False)
            return merge(o1, l1, o2, l2)

        return run

    out["cudnn_split"] = split(lambda q, k, v, causal: cudnn(q, k, v, causal, gqa))

    def engine() -> Any:  # the flex backend's long-row path: bucketed shapes, Triton merge
        o = flex_prefill.prefill(c.q, c.k, c.v, c.cache, c.table, c.prefix, SCALE)
        return o, None

    out["engine"] = engine
    out["flash_split"] = split(flash)
    if use_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fa = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        off = c.prefix

        def causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return ki <= qi + off

        bm = create_block_mask(causal, 1, 1, c.new, c.seq, device="cuda")

        def flex_run() -> Any:
            kv = c.gather(c.seq)
            o, lse = fa(
                bhsd(c.q),
                bhsd(kv[0]),
                bhsd(kv[1]),
                block_mask=bm,
                scale=SCALE,
                enable_gqa=True,
                return_lse=True,
            )
            return o[0].transpose(0, 1), lse[0].transpose(0, 1)

        out["flex"] = flex_run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="0,2048,16384,57344")
    ap.add_argument("--new", default="8192,512")
    ap.add_argument("--flex", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    for name in ("_cudnn_attention_forward", "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        print(f"{name}: {op.default._schema if op is not None else 'absent'}", flush=True)
    # Native GQA in the cuDNN op (K/V with 8 heads, Q with 32), or an expand first?
    gqa = "native"
    small = Case(0, 256, seed=1)
    rows = torch.arange(256, device="cuda")
    ref, _ = small.reference(rows)
    try:
        kv = small.gather(small.seq)
        o, _ = cudnn(small.q, kv[0], kv[1], True, "native")
        err = ((o[:256].float() - ref).norm() / ref.norm()).item()
        print(f"cuDNN, 8 KV heads under 32 query heads: rel err {err:.1e}", flush=True)
        if not err < 1e-2:
            gqa = "expand"
    except Exception as e:
        print(f"cuDNN native GQA failed ({e!r:.200}); expanding K/V", flush=True)
        gqa = "expand"
    # Which kernel SDPA runs for short rows inside the flex backend's _flash_first.
    from engine.attention.flex import _flash_first

    c0 = Case(0, 1024, seed=2)
    with _flash_first(c0.q.device):
        sdpa = F.scaled_dot_product_attention(
            bhsd(c0.q), bhsd(c0.k), bhsd(c0.v), is_causal=True, scale=SCALE, enable_gqa=True
        )[0].transpose(0, 1)
    default = F.scaled_dot_product_attention(
        bhsd(c0.q), bhsd(c0.k), bhsd(c0.v), is_causal=True, scale=SCALE, enable_gqa=True
    )[0].transpose(0, 1)
    fa = flash(c0.q, c0.k, c0.v, True)[0]
    dnn = cudnn(c0.q, c0.k, c0.v, True, gqa)[0]
    print(
        f"SDPA under _flash_first == flash op: {torch.equal(sdpa, fa)}, == cuDNN: "
        f"{torch.equal(sdpa, dnn)}; SDPA default == cuDNN: {torch.equal(default, dnn)}, "
        f"== flash: {torch.equal(default, fa)}",
        flush=True,
    )
    print(
        "\n| prefix | new | variant | ms | TFLOP/s | out rel err | lse max err | note |\n"
        "|---:|---:|---|---:|---:|---:|---:|---|",
        flush=True,
    )
    for new in [int(x) for x in args.new.split(",")]:
        for prefix in [int(x) for x in args.prefixes.split(",")]:
            c = Case(prefix, new)
            r = torch.cat([torch.arange(256), torch.arange(new - 256, new)]).cuda()
            r = r[r >= 0].unique()
            ref_o, ref_l = c.reference(r)
            flops = 4 * new * HQ * D * (prefix + (new + 1) / 2)
            gather_ms = events_ms(lambda c=c: c.gather(c.seq)) if prefix else 0.0
            print(f"| {prefix} | {new} | gather (prefix + new) | {gather_ms:.3f} | | | | |")
            for name, fn in variants(c, gqa, args.flex).items():
                note = ""
                try:
                    if name.startswith("cudnn") or name == "engine":
                        torch.cuda.synchronize()
                        t0 = torch.cuda.Event(enable_timing=True)
                        t1 = torch.cuda.Event(enable_timing=True)
                        t0.record()
                        fn()
                        t1.record()
                        torch.cuda.synchronize()
                        note = f"first call {t0.elapsed_time(t1):.1f} ms"
                    o, lse = fn()
                    err = ((o.index_select(0, r).float() - ref_o).norm() / ref_o.norm()).item()
                    lerr = (
                        float("nan")
                        if lse is None
                        else (lse.index_select(0, r).float() - ref_l).abs().max().item()
                    )
                    ms = events_ms(fn)
                except Exception as e:
                    print(f"| {prefix} | {new} | {name} | failed: {e!r:.160} | | | | |")
                    continue
                print(
                    f"| {prefix} | {new} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                    f"{err:.1e} | {lerr:.1e} | {note} |",
                    flush=True,
                )
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

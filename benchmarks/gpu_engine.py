"""The GPU engine at hardware speed: checks, then times, the "flex" backend with decode
CUDA graphs on a Llama-3-8B-shaped bf16 model with random weights (built in memory, no
download), against ceilings measured in the same run and against transformers.

    python benchmarks/gpu_engine.py [--out DIR] [--skip-hf] [--skip-prefill] [--contexts 1024,32768]
        [--many-rows triton|cublas] [--repeats N]
        [--compare unfused|gemv=OPS|one_row=inductor|many_rows=cublas|tail=float32|rope_in_write=off|before]...

The model builder, the ceilings and the checks live in benchmarks/gpu_engine_setup.py.

1. Ceilings: device copy bandwidth (read + write of a 4 GiB buffer), bf16 matmul rate
   (8192^3 on random data).
2. Checks: a tiny float32 Llama: greedy tokens of flex (graphs on, off) == torch reference
   == transformers; the 8B bf16 model: flex logits against the torch reference backend
   (relative error, argmax agreement) over a 1000-token prefill and 8 decode steps.
3. Decode ms/step in steady state (the engine's step around the model: execute, argmax,
   the next step launched ahead with the tokens on the device, the tokens read; host
   work included; also without launching ahead at 1K) and MBU at batch 1 / 32 / 128,
   contexts 1K and 32K. MBU counts weight bytes plus every sequence's KV
   bytes read. 32 x 32K tokens of KV (137 GB) does not fit next to the weights, so block
   tables draw blocks at random from a ~90 GB cache (sequences share blocks at random, as
   a prefix cache would; no two rows of one step read a block at the same moment by
   design, and the reads are spread over 90 GB, far past the 60 MB L2).
4. Prefill tok/s and MFU of 8K new tokens behind cached prefixes of 0 and 56K tokens.
5. transformers (sdpa, DynamicCache) at the same shapes where its contiguous cache fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import gpu_engine_setup as setup
from benchmarks.gpu_engine_setup import (
    LLAMA3_8B,
    SPEC_TFLOPS,
    FakeKV,
    FakeRequest,
    ceilings,
    check_big,
    check_tiny,
    hf_model,
    make_runner,
    ours,
    step_of,
    sync_time,
    weight_bytes,
)
from engine import cuda_graphs
from engine.attention import flex, flex_kv_write, flex_prefill
from engine.model_runner import ModelRunner
from engine.models import gemv as row_gemv
from engine.models import layer_ops, rows_gemm
from engine.models.layer_ops import EAGER, set_layer_ops
from engine.models.layer_ops import compiled as compiled_layer_ops


def decode_stepper(
    runner: ModelRunner, batch: int, ctx: int, num_blocks: int, seed: int, room: int, ahead: bool
) -> Any:
    """The engine's decode step around the model for `batch` greedy sequences at context
    `ctx` (room for `room` more tokens each): `execute`, argmax, the tokens' copy to the
    host queued, then (with `ahead`) `launch_ahead` of the next step with the tokens still
    on the device, then the wait for the tokens and the requests' advance by one token."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(ctx + 1 + room) // setup.BLOCK)
    need = batch * per_seq
    perm = torch.cat(
        [torch.randperm(num_blocks, generator=gen) for _ in range(-(-need // num_blocks))]
    )
    kv = FakeKV()
    reqs = []
    for i in range(batch):
        kv.tables[f"d{i}"] = perm[i * per_seq : (i + 1) * per_seq].tolist()
        reqs.append(FakeRequest(f"d{i}", [7] * (ctx + 1), ctx))
    sched = step_of(reqs, [1] * batch)
    host = torch.empty(batch, dtype=torch.int64, pin_memory=True)

    def step() -> None:
        logits = runner.execute(sched, cast(Any, kv))
        assert logits is not None
        tokens = logits.argmax(-1)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        if ahead:
            runner.launch_ahead(sched, cast(Any, kv), tokens)
        copied.synchronize()
        for r, t in zip(reqs, host.tolist(), strict=True):
            r.num_computed_tokens += 1
            r.all_token_ids.append(t)

    return step


def time_decode(
    runner: ModelRunner,
    batch: int,
    ctx: int,
    num_blocks: int,
    seed: int,
    ahead: bool = True,
    rounds: int = 3,
) -> tuple[float, int]:
    """Median ms of one decode step (decode_stepper) of `batch` sequences at context `ctx`
    in steady state, and the KV bytes one step reads. Steps run back to back (no device
    sync between them): ms/step = wall time of 20 steps / 20, median of `rounds`."""
    steps, warmup = 20, 3
    step = decode_stepper(runner, batch, ctx, num_blocks, seed, warmup + rounds * steps + 2, ahead)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps)
    runner.drop_ahead()
    torch.cuda.synchronize()
    c = runner.model.config
    kv_bytes = batch * (ctx + 1) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    return sorted(times)[rounds // 2] * 1e3, kv_bytes


def time_prefill(runner: ModelRunner, ctx: int, new: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one prefill step of `new` tokens behind `ctx` cached ones (the
    cache's random values stand for the prefix), and its last row's logits."""
    kv = FakeKV({"p": list(range(-(-(ctx + new) // setup.BLOCK)))[::-1]})
    req = FakeRequest("p", [11] * (ctx + new), ctx)
    sched = step_of([req], [new])
    out: list[torch.Tensor] = []

    def run() -> None:
        logits = runner.execute(sched, cast(Any, kv))
        assert logits is not None
        out[:] = [logits]

    return sync_time(run, 3, warmup=1), out[0][-1].float().clone()


def long_prefill_paths(model: Any, pairs: float) -> None:
    """Set the query-key pairs from which the flex backend's prefill rows run cuDNN's
    attention (engine/attention/flex_prefill.py); inf = every row on the flash path."""
    for layer in model.layers:
        layer.backend.long_prefill_pairs = pairs


def prefill_flops(cfg: dict[str, Any], n_params: int, ctx: int, new: int) -> float:
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    pairs = new * ctx + new * (new + 1) / 2
    attn = 4 * d * cfg["num_attention_heads"] * cfg["num_hidden_layers"] * pairs
    return 2 * n_params * new + attn


def hf_decode_ms(hf: Any, batch: int, ctx: int, steps: int = 12) -> float:
    ids = torch.randint(3, 128000, (batch, ctx), device="cuda")
    mask = torch.ones_like(ids)

    def gen(n: int) -> None:
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    t1 = sync_time(lambda: gen(1), 1, warmup=1)
    tn = sync_time(lambda: gen(1 + steps), 1, warmup=0)
    return (tn - t1) / steps * 1e3


def hf_prefill_s(hf: Any, ctx: int, new: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(3, 128000, (1, ctx + new), device="cuda")
    with torch.no_grad():
        cache = DynamicCache()
        if ctx:
            hf(ids[:, :ctx], past_key_values=cache, use_cache=True, logits_to_keep=1)

        def run() -> None:
            extra = cache.get_seq_length() - ctx if ctx else 0
            if extra:  # drop the previous run's 8K (a negative count removes tokens)
                cache.crop(-extra)
            hf(
                ids[:, ctx:],
                past_key_values=cache if ctx else None,
                use_cache=bool(ctx),
                logits_to_keep=1,
            )

        return sync_time(run, 3, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write report.json here")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cache-gb", type=float, default=88.0)
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block (tokens)")
    ap.add_argument(
        "--skip-prefill", action="store_true", help="decode timings only (prefill unchanged)"
    )
    ap.add_argument(
        "--compare",
        action="append",
        default=[],
        help="also time 1K decode with graphs of other layer ops: 'unfused' (eager ops; "
        "batch 1, 32, 128), 'gemv=OPS' (compiled, a GEMV kernel for one-row steps of "
        "the comma-separated ops only, cuBLAS for the others; batch 1), "
        "'one_row=inductor' (inductor's GEMV for one-row steps instead of "
        "engine/models/gemv.py's; batch 1), 'tuned' (the 128 bucket through inductor's "
        "max-autotune: layer_ops.TUNE_ROWS; batch 32, 128), 'blas=cublaslt' (cuBLASLt "
        "as torch's preferred BLAS; batch 32, 128) or 'many_rows=cublas' (cuBLAS for "
        "steps of 2-64 rows instead of engine/models/rows_gemm.py; batch 32, 128), "
        "'tail=float32' (graphs cast their logits to float32: cuda_graphs.FLOAT32_LOGITS; "
        "batch 32, 128), 'rope_in_write=off' (RoPE in the compiled glue, the K/V write "
        "apart: flex.ROPE_IN_WRITE; batch 32, 128) or 'before' (both; batch 32, 128); "
        "repeatable",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each 1K decode row (main and --compare rows) this many times, fresh "
        "block tables each; the row reports the median",
    )
    ap.add_argument(
        "--gemv-ops",
        default=",".join(sorted(layer_ops.GEMV_OPS)),
        help="ops whose one-row steps use inductor's GEMV in the main rows",
    )
    ap.add_argument(
        "--one-row",
        default=layer_ops.ONE_ROW,
        choices=["triton", "inductor"],
        help="GEMV of one-row steps in the main rows (engine/models/layer_ops.py ONE_ROW)",
    )
    ap.add_argument(
        "--contexts", default="1024,32768", help="decode contexts of the main rows (tokens)"
    )
    ap.add_argument(
        "--many-rows",
        default=layer_ops.MANY_ROWS,
        choices=["triton", "cublas"],
        help="matmuls of 2-64-row steps in the main rows (layer_ops.MANY_ROWS)",
    )
    args = ap.parse_args()
    layer_ops.ONE_ROW = args.one_row
    layer_ops.MANY_ROWS = args.many_rows
    gemv_ops = [n for n in args.gemv_ops.split(",") if n]
    layer_ops.GEMV_OPS = frozenset(gemv_ops)  # what ModelRunner's compiled ops use
    setup.BLOCK = args.block_size
    # One process compiles the layer ops for the tiny check, the 8B model and the
    # comparison's ops: more than dynamo's default 8 graphs per function.
    torch._dynamo.config.recompile_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = False
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "block_size": setup.BLOCK}
    bw, tflops = ceilings()
    report["ceilings"] = {"copy_gbps": bw, "matmul_tflops": tflops}
    print(f"ceilings: copy {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)

    check_tiny(report)

    t0 = time.perf_counter()
    hf = hf_model(LLAMA3_8B, torch.bfloat16)
    model = ours(hf, LLAMA3_8B, torch.bfloat16, "flex")
    print(f"8B models built in {time.perf_counter() - t0:.0f} s", flush=True)
    check_big(model, hf, report)

    hf_rows: dict[str, float] = {}
    if not args.skip_hf:
        for batch, ctx in ((1, 1024), (32, 1024), (128, 1024), (1, 32768)):
            hf_rows[f"decode b{batch} ctx{ctx}"] = hf_decode_ms(hf, batch, ctx)
            print(
                f"transformers decode b{batch} ctx{ctx}: {hf_rows[f'decode b{batch} ctx{ctx}']:.1f} ms",
                flush=True,
            )
        for ctx in (0, 57344):
            hf_rows[f"prefill ctx{ctx}"] = hf_prefill_s(hf, ctx, 8192)
            print(
                f"transformers prefill 8K ctx{ctx}: {hf_rows[f'prefill ctx{ctx}']:.3f} s",
                flush=True,
            )
    report["transformers"] = hf_rows
    del hf
    torch.cuda.empty_cache()

    wbytes = weight_bytes(model)
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed"))
    n_params -= model.config.vocab_size * model.config.hidden_size  # lm_head: one row only
    per_block = 2 * setup.BLOCK * 8 * 128 * 2 * 32
    num_blocks = int(args.cache_gb * 1e9 // per_block)
    rope_calls = [0]
    rope_write = flex_kv_write.rope_write

    def counted_rope_write(*a: Any, **kw: Any) -> torch.Tensor:
        rope_calls[0] += 1
        return rope_write(*a, **kw)

    flex_kv_write.rope_write = counted_rope_write  # layers that rotated in the write
    t0 = time.perf_counter()
    # Only the benchmarked batch sizes get graphs (each bucket compiles its own kernel).
    runner = make_runner(model, num_blocks, torch.bfloat16, True, 128, sizes=[1, 32, 128])
    report["rope_in_write_layers_at_capture"] = rope_calls[0]
    print(f"layers rotating in the K/V write during capture: {rope_calls[0]}", flush=True)
    start_s = time.perf_counter() - t0
    for c in runner.kv_caches:
        c.normal_()  # timing on zeros flatters kernels
    print(f"runner with {num_blocks} blocks; graphs captured in {start_s:.0f} s", flush=True)
    report["graph_capture_s"] = start_s
    report["layers_fused"] = bool(model.layers[0].ops.fused)  # type: ignore[union-attr]
    report["gemv_ops"] = gemv_ops
    report["one_row"] = layer_ops.ONE_ROW
    report["gemv_blocks"] = row_gemv.chosen()
    print(f"one-row GEMVs: {layer_ops.ONE_ROW}; block sizes timed: {row_gemv.chosen()}")
    report["many_rows"] = layer_ops.MANY_ROWS
    report["rows_gemm_chosen"] = rows_gemm.chosen()
    print(f"2-64-row matmuls: {layer_ops.MANY_ROWS}; chosen: {rows_gemm.chosen()}")
    print(f"decoder layers fused by torch.compile: {report['layers_fused']}", flush=True)

    def repeated(batch: int, ctx: int, seed: int) -> tuple[float, int, list[float]]:
        """Median ms, KV bytes and every repeat's ms of a decode row (repeats at 1K)."""
        times = []
        for i in range(args.repeats if ctx == 1024 else 1):
            ms, kvb = time_decode(runner, batch, ctx, num_blocks, seed=seed + 1000 * i)
            times.append(ms)
        return sorted(times)[len(times) // 2], kvb, times

    rows = []
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        for batch in (1, 32, 128):
            ms, kvb, times = repeated(batch, ctx, batch + ctx)
            mbu = (wbytes + kvb) / (ms / 1e3) / (bw * 1e9)
            hf_ms = hf_rows.get(f"decode b{batch} ctx{ctx}")
            rows.append(("decode", batch, ctx, ms, mbu, hf_ms))
            report[f"decode_b{batch}_ctx{ctx}_repeats_ms"] = times
            each = " / ".join(f"{t:.2f}" for t in times)
            print(f"decode b{batch} ctx{ctx}: {ms:.2f} ms/step ({each}), MBU {mbu:.0%}", flush=True)
    graphs = runner.graphs
    runner.graphs = None
    eager_ms, _ = time_decode(runner, 1, 1024, num_blocks, seed=5)
    runner.graphs = graphs
    report["decode_b1_ctx1k_graphs_off_ms"] = eager_ms
    print(f"decode b1 ctx1024 without CUDA graphs: {eager_ms:.2f} ms/step", flush=True)
    serial = {}
    for batch in (1, 32, 128):
        ms, _ = time_decode(runner, batch, 1024, num_blocks, seed=batch + 7, ahead=False)
        serial[f"b{batch}"] = ms
        print(f"decode b{batch} ctx1024 without launching ahead: {ms:.2f} ms/step", flush=True)
    report["decode_ctx1k_no_ahead_ms"] = serial
    for compare in args.compare if graphs is not None else []:
        # The same graphs over other layer ops: the eager ones ("unfused": what compiling
        # buys) or compiled ones with inductor's GEMV for one-row steps of the listed ops
        # only ("gemv=": cuBLAS for all; "gemv=attn_in,mlp": ...).
        tuned_rows = layer_ops.TUNE_ROWS
        if compare == "tuned":
            layer_ops.TUNE_ROWS = frozenset({128})
            other = compiled_layer_ops(gemv=gemv_ops)
        elif compare.startswith("blas="):
            torch.backends.cuda.preferred_blas_library(compare.removeprefix("blas="))
            other = compiled_layer_ops(gemv=gemv_ops)
        elif compare == "unfused":
            other = EAGER
        elif compare.startswith("many_rows="):
            other = compiled_layer_ops(gemv=gemv_ops, many_rows=compare.removeprefix("many_rows="))
        elif compare.startswith("one_row="):
            other = compiled_layer_ops(gemv=gemv_ops, one_row=compare.removeprefix("one_row="))
        elif compare in ("tail=float32", "rope_in_write=off", "before"):
            cuda_graphs.FLOAT32_LOGITS = compare in ("tail=float32", "before")
            flex.ROPE_IN_WRITE = compare == "tail=float32"
            other = compiled_layer_ops(gemv=gemv_ops)
        else:
            names = compare.removeprefix("gemv=")
            other = compiled_layer_ops(gemv=[n for n in names.split(",") if n])
        set_layer_ops(model, other)
        graphs.capture()
        alt = {}
        batches = (1, 32, 128) if compare == "unfused" else (1,)
        if compare in ("tuned", "tail=float32", "rope_in_write=off", "before"):
            batches = (32, 128)
        if compare.startswith(("blas=", "many_rows=")):
            batches = (32, 128)
        for batch in batches:
            ms, _, times = repeated(batch, 1024, batch + 1024)
            alt[f"b{batch}"] = ms
            alt[f"b{batch}_repeats"] = times  # type: ignore[assignment]
            each = " / ".join(f"{t:.2f}" for t in times)
            print(
                f"decode b{batch} ctx1024, graphs of {compare}: {ms:.2f} ms/step ({each})",
                flush=True,
            )
        report[f"decode_ctx1k_{compare}_ms"] = alt
        layer_ops.TUNE_ROWS = tuned_rows
        layer_ops.untune()
        torch.backends.cuda.preferred_blas_library("cublas")
        cuda_graphs.FLOAT32_LOGITS, flex.ROPE_IN_WRITE = False, True
    if args.compare and not args.skip_prefill:
        set_layer_ops(model, compiled_layer_ops(gemv=gemv_ops))
        graphs.capture()
    flash_rows = {}
    for ctx in () if args.skip_prefill else (0, 57344):
        # the flash path first (what every row ran before cuDNN's), then the default
        long_prefill_paths(model, float("inf"))
        s_flash, logits_flash = time_prefill(runner, ctx, 8192)
        long_prefill_paths(model, flex_prefill.MIN_PAIRS)
        s, logits = time_prefill(runner, ctx, 8192)
        diff = ((logits - logits_flash).norm() / logits_flash.norm()).item()
        same = bool(logits.argmax() == logits_flash.argmax())
        flops = prefill_flops(LLAMA3_8B, n_params, ctx, 8192)
        mfu = flops / s / 1e12
        hf_s = hf_rows.get(f"prefill ctx{ctx}")
        rows.append(("prefill", 1, ctx, s * 1e3, mfu, None if hf_s is None else hf_s * 1e3))
        flash_rows[f"ctx{ctx}"] = {"tok_s": 8192 / s_flash, "tflops": flops / s_flash / 1e12}
        report[f"prefill_ctx{ctx}_logits_vs_flash"] = {"rel": diff, "same_argmax": same}
        print(
            f"prefill 8K over {ctx}: {8192 / s:.0f} tok/s, {mfu:.0f} TFLOP/s "
            f"(flash path: {8192 / s_flash:.0f} tok/s, {flops / s_flash / 1e12:.0f} TFLOP/s; "
            f"last-row logits vs flash path {diff:.1e} relative, same argmax {same})",
            flush=True,
        )
    report["prefill_flash_path"] = flash_rows
    report["rows"] = rows

    print("\n| what | batch | context | kvserve flex | of ceiling | transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, batch, ctx, ms, x, hf_ms in rows:
        hf_s = "does not fit" if hf_ms is None and kind == "decode" else "-"
        if kind == "decode":
            if hf_ms is not None:
                hf_s = f"{hf_ms:.1f} ms/step"
            print(f"| decode | {batch} | {ctx} | {ms:.2f} ms/step | MBU {x:.0%} | {hf_s} |")
        else:
            if hf_ms is not None:
                hf_s = f"{8192 / hf_ms * 1e3:,.0f} tok/s"
            print(
                f"| prefill 8K | 1 | {ctx} | {8192 / ms * 1e3:,.0f} tok/s | "
                f"MFU {x / tflops:.0%} ({x / SPEC_TFLOPS:.0%} of spec) | {hf_s} |"
            )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

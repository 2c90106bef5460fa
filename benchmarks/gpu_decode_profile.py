"""Where a decode step of the 8B-shaped model goes (one GPU): the step's wall time, the
host part (execute returning, before the sync), the kernels of one graph replay grouped
by name (torch.profiler) and by class against the bytes the class must read (matmuls:
the weights; attention: the KV of every row), and the flex decode kernel alone under a
few kernel options.

    python benchmarks/gpu_decode_profile.py [--cases 1x1024,128x1024] [--no-variants]
        [--many-rows triton|cublas|triton,cublas]

Each matmul shape alone, weights cold, per tiling: benchmarks/gpu_gemv.py.

Same model, cache and step as benchmarks/gpu_engine.py (random bf16 Llama-3-8B shape,
flex + decode graphs + compiled layers, block size 16, 88 GB cache of random values).
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
from benchmarks.gpu_engine_setup import (
    BLOCK,
    LLAMA3_8B,
    FakeKV,
    FakeRequest,
    ceilings,
    hf_model,
    make_runner,
    ours,
    step_of,
    sync_time,
    weight_bytes,
)
from engine.attention import flex
from engine.model_runner import ModelRunner
from engine.models import layer_ops, rows_gemm
from engine.models.layer_ops import compiled as compiled_layer_ops
from engine.models.layer_ops import set_layer_ops

CLASSES = (
    ("matmul", ("gemm", "nvjet", "cutlass", "splitk", "gemv_kernel")),
    ("attention", ("flex", "tem_fused")),
    ("kv write", ("write_kv",)),
)
"""Kernel classes by (lower-case) name fragment; the rest is glue (norms, RoPE, SwiGLU,
residuals, argmax, input gathers)."""


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, parts in CLASSES if any(p in low for p in parts)), "glue")


def decode_case(runner: ModelRunner, batch: int, ctx: int, num_blocks: int) -> Any:
    gen = torch.Generator().manual_seed(batch + ctx)
    per_seq = -(-(ctx + 1) // BLOCK)
    perm = torch.randperm(num_blocks, generator=gen)
    kv = FakeKV()
    reqs = []
    for i in range(batch):
        kv.tables[f"d{i}"] = perm[i * per_seq : (i + 1) * per_seq].tolist()
        reqs.append(FakeRequest(f"d{i}", [7] * (ctx + 1), ctx))
    sched = step_of(reqs, [1] * batch)

    def step() -> None:
        logits = runner.execute(sched, cast(Any, kv))
        assert logits is not None
        logits.argmax(-1).tolist()

    return step, sched, kv


def host_ms(runner: ModelRunner, sched: Any, kv: Any, reps: int = 20) -> float:
    """Median ms of execute() returning (host preparation + launches), device idle first."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.execute(sched, kv)
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return sorted(times)[reps // 2] * 1e3


def kernel_table(
    step: Any, top: int = 14
) -> tuple[float, list[tuple[str, int, float]], dict[str, float]]:
    """(kernel ms per step, [(name, launches per step, ms per step)], {class: ms per
    step}) over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name[:90], [0, 0.0])
        r[0] += 1
        r[1] += e.device_time_total / 1e3
    total = sum(r[1] for r in rows.values()) / reps
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    classes: dict[str, float] = {}
    for n, (_, t) in rows.items():
        classes[kernel_class(n)] = classes.get(kernel_class(n), 0.0) + t / reps
    return total, [(n, int(c) // reps, t / reps) for n, (c, t) in ranked], classes


def kernel_variants(
    runner: ModelRunner, batch: int, ctx: int, bs: int, options: list[dict[str, Any]]
) -> None:
    """The compiled flex decode kernel alone on layer 0's cache viewed in blocks of `bs`
    slots (random tables), under each kernel_options (CUDA events, 50 calls)."""
    cache = runner.kv_caches[0]
    _, nb, cache_bs, hkv, d = cache.shape
    num_slots = nb * cache_bs
    gen = torch.Generator().manual_seed(3)
    per_seq = -(-(ctx + 1) // bs)
    blocks = torch.randperm(num_slots // bs, generator=gen)[: batch * per_seq]
    tables = blocks.view(batch, per_seq)
    width = 1 << (per_seq - 1).bit_length()
    tables = torch.nn.functional.pad(tables, (0, width - per_seq)).to("cuda", torch.int32)
    lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device="cuda")
    mask = flex.decode_block_mask(tables, lens, bs, num_slots)
    q = torch.randn(batch, 32, 1, d, device="cuda", dtype=cache.dtype)
    keys = cache[0].view(1, -1, hkv, d).transpose(1, 2)
    values = cache[1].view(1, -1, hkv, d).transpose(1, 2)
    kernel = flex._flex()
    kv_bytes = batch * (ctx + 1) * hkv * d * 2 * cache.element_size()
    for opts in options:

        def call(opts: dict[str, Any] = opts) -> Any:
            return kernel(
                q,
                keys,
                values,
                block_mask=mask,
                scale=d**-0.5,
                enable_gqa=True,
                return_lse=True,
                kernel_options=opts,
            )

        try:
            call()
        except Exception as e:  # an option the kernel does not take: say so, go on
            print(f"flex decode b{batch} ctx{ctx} block {bs} {opts}: failed ({e!r:.120})")
            continue
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(50):
            call()
        t1.record()
        torch.cuda.synchronize()
        ms = t0.elapsed_time(t1) / 50
        print(
            f"flex decode alone b{batch} ctx{ctx} block {bs} {opts}: {ms * 1e3:.0f} us, "
            f"{kv_bytes / ms / 1e6:.0f} GB/s",
            flush=True,
        )


def profile_cases(
    runner: ModelRunner, cases: list[tuple[int, ...]], num_blocks: int, wbytes: int, bw: float
) -> None:
    """Step time, MBU, host time, top kernels and kernel classes of each (batch, context)."""
    c = runner.model.config
    print("| batch | context | ms/step | MBU | host ms (execute) | kernel ms |")
    for batch, ctx in cases:
        step, sched, kv = decode_case(runner, batch, ctx, num_blocks)
        ms = sync_time(step, 20, warmup=3) * 1e3
        kvb = batch * (ctx + 1) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
        mbu = (wbytes + kvb) / (ms / 1e3) / (bw * 1e9)
        h = host_ms(runner, sched, kv)
        total, kernels, classes = kernel_table(step)
        print(f"| {batch} | {ctx} | {ms:.2f} | {mbu:.0%} | {h:.2f} | {total:.2f} |", flush=True)
        for name, count, kms in kernels:
            print(f"    {kms:7.3f} ms  x{count:<4d} {name}", flush=True)
        class_bytes = {"matmul": wbytes, "attention": kvb}
        for cls, cms in sorted(classes.items(), key=lambda kv: -kv[1]):
            rate = ""
            if cls in class_bytes:
                gb = class_bytes[cls] / 1e9
                rate = f", {gb:.1f} GB at {class_bytes[cls] / cms / 1e6:,.0f} GB/s"
            print(f"  class {cls}: {cms:.3f} ms{rate}", flush=True)


def timeline(step: Any, out: Path | None, label: str, reps: int = 4) -> None:
    """The kernels of `reps` engine steps (decode_stepper: decode ahead, no sync between
    steps) in device order from torch.profiler's trace: per step the kernel count, busy
    time and idle gaps (intra-step under 20 us, longer ones apart), then one middle
    layer's kernels and the step boundary, each with its duration and the gap before it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    path = (out or Path("/tmp")) / f"trace_{label.replace('+', '_')}.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    evs = sorted(
        (e["ts"], e["dur"], e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    if not evs:
        print(f"timeline {label}: no device events traced", flush=True)
        return
    gaps = [evs[i][0] - (evs[i - 1][0] + evs[i - 1][1]) for i in range(1, len(evs))]
    span = evs[-1][0] + evs[-1][1] - evs[0][0]
    busy = sum(d for _, d, _ in evs)
    small = sum(g for g in gaps if g < 20)
    large = [g for g in gaps if g >= 20]
    print(
        f"timeline {label}: {len(evs) / reps:.0f} device ops per step; per step "
        f"{span / reps / 1e3:.3f} ms span (first to last op of {reps} steps), busy "
        f"{busy / reps / 1e3:.3f} ms, gaps < 20 us {small / reps / 1e3:.3f} ms "
        f"({sum(1 for g in gaps if g < 20) / reps:.0f} of them), gaps >= 20 us "
        f"{sum(large) / reps / 1e3:.3f} ms ({len(large)} in all: "
        f"{', '.join(f'{g:.0f}' for g in large[:12])} us)",
        flush=True,
    )
    classes: dict[str, float] = {}
    for _, d, n in evs:
        classes[kernel_class(n)] = classes.get(kernel_class(n), 0.0) + d / reps / 1e3
    print("  classes: " + ", ".join(f"{c} {ms:.3f} ms" for c, ms in classes.items()))
    attn = [i for i, (_, _, n) in enumerate(evs) if "tem_fused" in n]  # the decode kernels
    layers = len(attn) // reps
    if len(attn) < layers * 2 or layers < 8:
        return

    def show(lo: int, hi: int, what: str) -> None:
        print(f"  {what}: {hi - lo} ops")
        for i in range(lo, hi):
            gap = evs[i][0] - (evs[i - 1][0] + evs[i - 1][1]) if i else 0.0
            print(f"    {evs[i][1]:7.1f} us  gap {gap:5.1f}  {evs[i][2][:110]}")

    show(attn[layers // 2] + 1, attn[layers // 2 + 1] + 1, "one middle layer (after attention)")
    show(
        attn[layers - 1] + 1,
        attn[layers] + 1,
        "step boundary (last layer's attention to the next step's first)",
    )


def engine_rows(
    runner: ModelRunner, num_blocks: int, wbytes: int, bw: float, repeats: int, label: str
) -> None:
    """gpu_engine.py's decode rows (decode ahead, 20 steps x median of 5) at 1K context,
    batch 1 / 32 / 128, `repeats` times with fresh block tables."""
    from benchmarks.gpu_engine import time_decode

    for batch in (1, 32, 128):
        got = []
        for r in range(repeats):
            ms, kvb = time_decode(runner, batch, 1024, num_blocks, seed=batch + 97 * r, rounds=5)
            got.append(ms)
        mbu = (wbytes + kvb) / (sorted(got)[len(got) // 2] / 1e3) / (bw * 1e9)
        print(
            f"engine {label} b{batch} ctx1024: "
            + " / ".join(f"{ms:.2f}" for ms in got)
            + f" ms/step (MBU {mbu:.0%} at the median)",
            flush=True,
        )


def apply_variant(model: Any, runner: ModelRunner, name: str) -> None:
    """Recapture the decode graphs under `name`: '+'-joined settings of copies
    (layer_ops.COPY_FREE_RESIDUALS off: inductor's addmm with its copy of x), lse (the
    flex decode kernel returns its LSE whether needed or not), stages4 (4 pipelining
    stages in flex decode), static128 (the 128 bucket compiled for its static shape) and
    cublaslt (torch's preferred BLAS); 'base' = none. Without static128 a 300-token
    prefill runs before the capture, so that the 128 bucket runs the compilation for a
    symbolic row count, as in gpu_engine.py (whose checks prefill first); the start-up
    capture (variant 'start', no recapture) compiled T = 128 first, for that shape."""
    parts = set(name.split("+")) - {"base", "start"}
    unknown = parts - {"copies", "lse", "stages4", "static128", "cublaslt"}
    if unknown:
        raise SystemExit(f"unknown variant settings {sorted(unknown)}")
    layer_ops.COPY_FREE_RESIDUALS = "copies" not in parts
    flex.DECODE_STAGES = 4 if "stages4" in parts else 3
    flex.DECODE_LSE_ALWAYS = "lse" in parts
    layer_ops.TUNE_ROWS = frozenset({128}) if "static128" in parts else frozenset()
    layer_ops.TUNED_OPTIONS = {}
    layer_ops.untune()
    layer_ops._COMPILED = None
    torch.backends.cuda.preferred_blas_library("cublaslt" if "cublaslt" in parts else "cublas")
    set_layer_ops(model, compiled_layer_ops())
    if "static128" not in parts:
        kv = FakeKV({"w": list(range(-(-300 // BLOCK)))})
        runner.execute(step_of([FakeRequest("w", [11] * 300, 0)], [300]), cast(Any, kv))
        torch.cuda.synchronize()
    assert runner.graphs is not None
    runner.graphs.capture()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-gb", type=float, default=88.0)
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--only-variants", action="store_true")
    ap.add_argument("--cases", default="1x1024,32x1024,128x1024,1x32768", help="BATCHxCONTEXT,...")
    ap.add_argument(
        "--many-rows",
        default=layer_ops.MANY_ROWS,
        help="2-64-row matmuls (layer_ops.MANY_ROWS): triton, cublas, or both in turn "
        "(triton,cublas: the graphs recaptured)",
    )
    ap.add_argument("--out", default=None, help="write the traces here")
    ap.add_argument(
        "--engine",
        default="",
        help="comma-separated variants (apply_variant: start, base, copies, lse, stages4, "
        "static128, cublaslt, '+'-joined): for each, gpu_engine.py's 1K decode rows and the "
        "128 x 1K timeline instead of the profile above",
    )
    ap.add_argument("--repeats", type=int, default=3, help="engine rows per variant")
    ap.add_argument(
        "--flex-options",
        default='[{"num_stages": 1}, {"num_stages": 2}, {"num_stages": 3}]',
        help="JSON list of flex decode kernel_options, each over the engine's split and "
        "16-slot tiles, for the kernel alone",
    )
    args = ap.parse_args()
    layer_ops.MANY_ROWS = args.many_rows.split(",")[0]
    torch._dynamo.config.recompile_limit = 64  # the layer ops compile once per mode
    torch.backends.cuda.matmul.allow_tf32 = False
    bw, tflops = ceilings()
    print(f"ceilings: copy {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    hf = hf_model(LLAMA3_8B, torch.bfloat16)
    model = ours(hf, LLAMA3_8B, torch.bfloat16, "flex")
    del hf
    torch.cuda.empty_cache()
    wbytes = weight_bytes(model)
    per_block = 2 * BLOCK * 8 * 128 * 2 * 32
    num_blocks = int(args.cache_gb * 1e9 // per_block)
    t0 = time.perf_counter()
    runner = make_runner(model, num_blocks, torch.bfloat16, True, 128, sizes=[1, 32, 128])
    print(f"graphs captured in {time.perf_counter() - t0:.0f} s", flush=True)
    for c in runner.kv_caches:
        c.normal_()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",") if c]
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for name in (v for v in args.engine.split(",") if v):
        from benchmarks.gpu_engine import decode_stepper

        if name != "start":
            t0 = time.perf_counter()
            apply_variant(model, runner, name)
            print(f"variant {name}: recaptured in {time.perf_counter() - t0:.0f} s", flush=True)
        engine_rows(runner, num_blocks, wbytes, bw, args.repeats, name)
        step = decode_stepper(runner, 128, 1024, num_blocks, 5, 40, ahead=True)
        timeline(step, out, name)
        runner.drop_ahead()
    if args.engine:
        cases = [] if args.no_variants else cases
    modes = [m for m in args.many_rows.split(",") if m]
    for i, mode in enumerate([] if args.only_variants or args.engine else modes):
        if i:  # the same graphs recaptured over the other 2-64-row matmuls
            set_layer_ops(model, compiled_layer_ops(many_rows=mode))
            assert runner.graphs is not None
            runner.graphs.capture()
        print(f"2-64-row matmuls: {mode}; chosen: {rows_gemm.chosen()}", flush=True)
        profile_cases(runner, cases, num_blocks, wbytes, bw)
    if args.no_variants:
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, ctx in cases:
        base = {"BLOCK_N": 16, "SPLIT_KV": max(1, -(-4 * sms // (batch * 8)))}
        opts = [base] + [{**base, **o} for o in json.loads(args.flex_options)]
        kernel_variants(runner, batch, ctx, 16, opts)


if __name__ == "__main__":
    main()

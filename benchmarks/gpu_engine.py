"""The GPU engine at hardware speed: checks, then times, the "flex" backend with decode
CUDA graphs on a Llama-3-8B-shaped bf16 model with random weights (built in memory, no
download), against ceilings measured in the same run and against transformers.

    python benchmarks/gpu_engine.py [--out DIR] [--skip-hf]

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.attention.base import get_backend
from engine.model_runner import ModelRunner
from engine.models import layer_ops
from engine.models.layer_ops import EAGER, set_layer_ops
from engine.models.layer_ops import compiled as compiled_layer_ops
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from engine.scheduler import ScheduledRequest
from modelinfo.config import model_config_from_hf
from protocol.kv_layout import KVLayout

BLOCK = 16
"""KV cache block size (tokens); --block-size sets it."""
SPEC_TFLOPS = 989.0
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


# -- a scheduler stand-in: fixed block tables, what ModelRunner.execute reads -----------
@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeKV:
    tables: dict[str, list[int]] = field(default_factory=dict)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def step_of(reqs: list[FakeRequest], num_new: list[int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(cast(Any, r), n) for r, n in zip(reqs, num_new, strict=True)]


def sync_time(fn: Any, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def ceilings() -> tuple[float, float]:
    """(copy GB/s read + write, bf16 matmul TFLOP/s), medians of 10 timed runs."""
    src = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB x 2
    dst = torch.empty_like(src)
    t = sync_time(lambda: dst.copy_(src), 10)
    bw = 2 * src.numel() * 2 / t / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = sync_time(lambda: a @ b, 10)
    return bw, 2 * 8192**3 / t / 1e12


def hf_model(cfg: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> Any:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = HFLlama(LlamaConfig(**cfg, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def ours(hf: Any, cfg: dict[str, Any], dtype: torch.dtype, backend: str) -> LlamaForCausalLM:
    mc = model_config_from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
    return build_model(
        mc,
        dtype=dtype,
        device="cuda",
        backend=get_backend(backend),
        weights=dict(hf.state_dict()),
    )


def make_runner(
    model: LlamaForCausalLM,
    num_blocks: int,
    dtype: torch.dtype,
    graphs: bool,
    max_batch: int,
    sizes: list[int] | None = None,
    compile_layers: bool = True,
) -> ModelRunner:
    c = model.config
    layout = KVLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
    )
    backend = model.layers[0].backend  # type: ignore[union-attr]
    return ModelRunner(
        model,
        layout,
        num_blocks,
        device=torch.device("cuda"),
        dtype=dtype,
        backend=backend,
        cuda_graphs=graphs,
        max_batch=max_batch,
        graph_sizes=sizes,
        compile_layers=compile_layers,
    )


def set_backend(model: LlamaForCausalLM, name: str) -> None:
    backend = get_backend(name)
    for layer in model.layers:
        layer.backend = backend  # type: ignore[union-attr]


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one mixed step, then `steps` decode steps of all."""
    kv = FakeKV()
    reqs = []
    nxt = 0
    for i, p in enumerate(prompts):
        n = -(-(len(p) + steps) // BLOCK)
        kv.tables[f"r{i}"] = list(range(nxt, nxt + n))[::-1]  # out of order
        nxt += n
        reqs.append(FakeRequest(f"r{i}", list(p), 0))
    new = [len(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = runner.execute(step_of(reqs, new), cast(Any, kv))
        assert logits is not None
        toks = logits.argmax(-1).tolist()
        for r, n, t, o in zip(reqs, new, toks, outs, strict=True):
            r.num_computed_tokens += n
            r.all_token_ids.append(t)
            o.append(t)
        new = [1] * len(reqs)
    return outs


def check_tiny(report: dict[str, Any]) -> None:
    hf = hf_model(TINY, torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (5, 40, 130, 300)]
    results = {}
    for name, backend, graphs, fuse in (
        ("torch", "torch", False, False),
        ("flex+graphs+compiled layers", "flex", True, True),
        ("flex+graphs", "flex", True, False),
        ("flex eager", "flex", False, False),
    ):
        model = ours(hf, TINY, torch.float32, backend)
        runner = make_runner(model, 256, torch.float32, graphs, 8, compile_layers=fuse)
        results[name] = greedy(runner, prompts, 24)
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        ref.append(out[0, len(p) :].tolist())
    results["transformers"] = ref
    same = {k: v == results["torch"] for k, v in results.items()}
    report["tiny_fp32_greedy_identical"] = same
    print("tiny float32 greedy tokens identical to the torch backend:", same, flush=True)
    assert all(same.values()), results


def check_big(model: LlamaForCausalLM, hf: Any, report: dict[str, Any]) -> None:
    """flex vs the torch reference backend on the 8B model, same inputs (three prompts,
    then 8 teacher-forced decode steps), separate small caches. In bf16 the two differ by
    rounding, so each is also compared with transformers (an independent bf16 stack): flex
    must be as close to it as the reference is."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in (1000, 37, 300)]
    steps = 9
    forced = [[1000 + 7 * (s + 1) + i for s in range(steps)] for i in range(3)]
    logits = {}
    for name in ("torch", "flex"):
        set_backend(model, name)
        runner = make_runner(model, 256, torch.bfloat16, False, 4)
        kv = FakeKV({f"r{i}": list(range(80 * i, 80 * i + 80))[::-1] for i in range(3)})
        reqs = [FakeRequest(f"r{i}", list(p), 0) for i, p in enumerate(prompts)]
        new = [len(p) for p in prompts]
        rows = []
        for s in range(steps):
            out = runner.execute(step_of(reqs, new), cast(Any, kv))
            assert out is not None
            rows.append(out.float())
            for i, (r, n) in enumerate(zip(reqs, new, strict=True)):
                r.num_computed_tokens += n
                r.all_token_ids.append(forced[i][s])
            new = [1] * 3
        logits[name] = torch.cat(rows)  # row s * 3 + i
        del runner
    hf_rows = torch.empty_like(logits["torch"])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + forced[i][: steps - 1]], device="cuda")
            out = hf(ids).logits[0, len(p) - 1 :].float()  # [steps, V]
            hf_rows[i::3] = out
    logits["transformers"] = hf_rows

    def rel(a: str, b: str) -> float:
        return ((logits[a] - logits[b]).norm() / logits[b].norm()).item()

    def agree(a: str, b: str) -> float:
        return (logits[a].argmax(-1) == logits[b].argmax(-1)).float().mean().item()

    res = {
        "flex_vs_torch": (rel("flex", "torch"), agree("flex", "torch")),
        "flex_vs_transformers": (rel("flex", "transformers"), agree("flex", "transformers")),
        "torch_vs_transformers": (rel("torch", "transformers"), agree("torch", "transformers")),
        "rows": logits["torch"].shape[0],
    }
    report["bf16_8b_logits_rel_err_argmax_agree"] = res
    print(f"8B bf16 logits (rel err, argmax agreement): {res}", flush=True)
    f_rel, f_agree = res["flex_vs_transformers"]
    t_rel, t_agree = res["torch_vs_transformers"]
    assert f_rel <= 1.5 * t_rel + 1e-3 and f_agree >= t_agree - 0.1, res
    set_backend(model, "flex")


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads: every matrix but the embedding (one row per token)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or name.startswith("embed_tokens"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def time_decode(
    runner: ModelRunner, batch: int, ctx: int, num_blocks: int, seed: int, ahead: bool = True
) -> tuple[float, int]:
    """Median ms of one decode step of `batch` sequences at context `ctx` in steady state,
    and the KV bytes one step reads. A step is what LLMEngine.step does around the model
    for greedy rows: `execute`, argmax, the tokens' copy to the host queued, then (with
    `ahead`) `launch_ahead` of the next step with the tokens still on the device, then the
    wait for the tokens and the requests' advance by one token. Steps run back to back
    (no device sync between them): ms/step = wall time of 20 steps / 20, median of 3."""
    gen = torch.Generator().manual_seed(seed)
    steps, warmup, rounds = 20, 3, 3
    room = warmup + rounds * steps + 2  # tokens the requests grow by
    per_seq = -(-(ctx + 1 + room) // BLOCK)
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


def time_prefill(runner: ModelRunner, ctx: int, new: int) -> float:
    kv = FakeKV({"p": list(range(-(-(ctx + new) // BLOCK)))[::-1]})
    req = FakeRequest("p", [11] * (ctx + new), ctx)
    sched = step_of([req], [new])
    return sync_time(lambda: runner.execute(sched, cast(Any, kv)), 3, warmup=1)


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
        "batch 1, 32, 128) or 'gemv=OPS' (compiled, inductor's GEMV for one-row steps of "
        "the comma-separated ops only, cuBLAS for the others; batch 1); repeatable",
    )
    ap.add_argument(
        "--gemv-ops",
        default=",".join(sorted(layer_ops.GEMV_OPS)),
        help="ops whose one-row steps use inductor's GEMV in the main rows",
    )
    args = ap.parse_args()
    gemv_ops = [n for n in args.gemv_ops.split(",") if n]
    layer_ops.GEMV_OPS = frozenset(gemv_ops)  # what ModelRunner's compiled ops use
    global BLOCK
    BLOCK = args.block_size
    # One process compiles the layer ops for the tiny check, the 8B model and the
    # comparison's ops: more than dynamo's default 8 graphs per function.
    torch._dynamo.config.recompile_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = False
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "block_size": BLOCK}
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
    per_block = 2 * BLOCK * 8 * 128 * 2 * 32
    num_blocks = int(args.cache_gb * 1e9 // per_block)
    t0 = time.perf_counter()
    # Only the benchmarked batch sizes get graphs (each bucket compiles its own kernel).
    runner = make_runner(model, num_blocks, torch.bfloat16, True, 128, sizes=[1, 32, 128])
    start_s = time.perf_counter() - t0
    for c in runner.kv_caches:
        c.normal_()  # timing on zeros flatters kernels
    print(f"runner with {num_blocks} blocks; graphs captured in {start_s:.0f} s", flush=True)
    report["graph_capture_s"] = start_s
    report["layers_fused"] = bool(model.layers[0].ops.fused)  # type: ignore[union-attr]
    report["gemv_ops"] = gemv_ops
    print(f"decoder layers fused by torch.compile: {report['layers_fused']}", flush=True)

    rows = []
    for ctx in (1024, 32768):
        for batch in (1, 32, 128):
            ms, kvb = time_decode(runner, batch, ctx, num_blocks, seed=batch + ctx)
            mbu = (wbytes + kvb) / (ms / 1e3) / (bw * 1e9)
            hf_ms = hf_rows.get(f"decode b{batch} ctx{ctx}")
            rows.append(("decode", batch, ctx, ms, mbu, hf_ms))
            print(f"decode b{batch} ctx{ctx}: {ms:.2f} ms/step, MBU {mbu:.0%}", flush=True)
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
        if compare == "unfused":
            other = EAGER
        else:
            names = compare.removeprefix("gemv=")
            other = compiled_layer_ops(gemv=[n for n in names.split(",") if n])
        set_layer_ops(model, other)
        graphs.capture()
        alt = {}
        for batch in (1, 32, 128) if compare == "unfused" else (1,):
            ms, _ = time_decode(runner, batch, 1024, num_blocks, seed=batch + 1024)
            alt[f"b{batch}"] = ms
            print(f"decode b{batch} ctx1024, graphs of {compare}: {ms:.2f} ms/step", flush=True)
        report[f"decode_ctx1k_{compare}_ms"] = alt
    if args.compare:
        set_layer_ops(model, compiled_layer_ops(gemv=gemv_ops))
        graphs.capture()
    for ctx in () if args.skip_prefill else (0, 57344):
        s = time_prefill(runner, ctx, 8192)
        flops = prefill_flops(LLAMA3_8B, n_params, ctx, 8192)
        mfu = flops / s / 1e12
        hf_s = hf_rows.get(f"prefill ctx{ctx}")
        rows.append(("prefill", 1, ctx, s * 1e3, mfu, None if hf_s is None else hf_s * 1e3))
        print(f"prefill 8K over {ctx}: {8192 / s:.0f} tok/s, {mfu:.0f} TFLOP/s", flush=True)
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

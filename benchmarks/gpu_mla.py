"""The engine on a DeepSeek-V2-Lite-shaped random model (MLA + MoE, bf16, built in memory,
no download): checks against transformers, then decode MBU and prefill MFU. The
DeepSeek counterpart of benchmarks/gpu_engine.py (whose scheduler stand-ins it reuses).

    python benchmarks/gpu_mla.py [--out DIR]                 # CUDA, V2-Lite shape
    python benchmarks/gpu_mla.py --device cpu --tiny         # the same path, tiny, on CPU

1. Checks: a tiny float32 DeepSeek-V2: greedy tokens of the engine (torch backend, latent
   cache, absorbed decode) == transformers; the big bf16 model: engine logits against
   transformers' over a 512-token prefill (relative error, argmax agreement).
2. Decode ms/step (ModelRunner.execute + argmax, host preparation included) and MBU at
   batch 1 / 32 / 128, contexts 1K and 8K. Bytes a step reads: the dense weights, the
   shared experts, the routed experts the batch touches (expected distinct experts of
   uniform top-k routing: E (1 - (1 - k/E)^B) per layer), and every sequence's latent KV
   (576 elements per token per layer). Block tables draw blocks at random from the cache.
3. Prefill tok/s and MFU of 4K new tokens (2 x activated parameters per token, plus the
   absorbed attention: per head and (query, key) pair 2 (L + R) + 2 L FLOPs).

MLA runs on the torch backends only (flex refuses MLA models), so these are the torch
reference path's numbers: a baseline for a FlexAttention/FlashMLA path, not a ceiling.
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
from benchmarks.gpu_engine_setup import FakeKV, FakeRequest, step_of
from engine.attention.base import get_backend
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from modelinfo.config import ModelConfig, model_config_from_hf
from protocol.kv_layout import KVLayout

BLOCK = 16
SPEC_TFLOPS = 989.0
DEEPSEEK_V2_LITE: dict[str, Any] = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    max_position_embeddings=163840,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY: dict[str, Any] = {
    **DEEPSEEK_V2_LITE,
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 16384,
    "rope_parameters": {**DEEPSEEK_V2_LITE["rope_parameters"], "factor": 4.0},
    "initializer_range": 0.2,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def hf_model(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v2", **cfg, attn_implementation="sdpa")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # random routers route at random; give them some spread
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.5)
    return model.eval()


def model_config(cfg: dict[str, Any]) -> ModelConfig:
    return model_config_from_hf({**cfg, "architectures": ["DeepseekV2ForCausalLM"]})


def hub_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 holds a layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) and writes the Hub's per-expert names on save; the
    engine reads the latter, so split the stacks (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = gate[e]
                out[f"{stem}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            stem = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def ours(
    hf: Any, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    return build_model(
        model_config(cfg),
        dtype=dtype,
        device=device,
        backend=get_backend("torch"),
        weights=hub_names(dict(hf.state_dict())),
    )


def make_runner(model: LlamaForCausalLM, num_blocks: int, device: torch.device) -> ModelRunner:
    c = model.config
    layout = KVLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[model.dtype],
        kind=c.kv_kind,
    )
    return ModelRunner(
        model,
        layout,
        num_blocks,
        device=device,
        dtype=model.dtype,
        backend=get_backend("torch"),
        cuda_graphs=False,
    )


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one mixed step, then `steps` - 1 decode steps of all."""
    kv = FakeKV()
    reqs, nxt = [], 0
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
        for r, n, t, o in zip(reqs, new, logits.argmax(-1).tolist(), outs, strict=True):
            r.num_computed_tokens += n
            r.all_token_ids.append(t)
            o.append(t)
        new = [1] * len(reqs)
    return outs


def greedy_vs_transformers(
    hf: Any, runner: ModelRunner, vocab: int, device: torch.device
) -> tuple[list[list[int]], list[list[int]]]:
    """16 greedy tokens of 3 seeded prompts (5, 40, 130 tokens): the engine's (one mixed
    prefill step, then batched decodes) and transformers' generate."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    got = greedy(runner, prompts, 16)
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        ref.append(out[0, len(p) :].tolist())
    return got, ref


def check_tiny(device: torch.device, report: dict[str, Any]) -> None:
    hf = hf_model(TINY, torch.float32, device)
    runner = make_runner(ours(hf, TINY, torch.float32, device), 128, device)
    got, ref = greedy_vs_transformers(hf, runner, 4096, device)
    report["tiny_fp32_greedy_identical"] = got == ref
    print("tiny float32 DeepSeek-V2 greedy tokens == transformers:", got == ref, flush=True)
    assert got == ref, (got, ref)


def check_big(
    model: LlamaForCausalLM, hf: Any, device: torch.device, report: dict[str, Any]
) -> None:
    """Engine vs transformers logits of every position of one 512-token prompt."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (512,), generator=gen).to(device)
    runner = make_runner(model, 64, device)
    hidden = model(ids, torch.arange(512, device=device), runner.kv_caches, _meta(512, device))
    got = model.compute_logits(hidden)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    rel = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    report["vs_transformers"] = {"rel_err": rel, "argmax_agree": agree}
    print(f"engine vs transformers: rel err {rel:.2e}, argmax agree {agree:.1%}", flush=True)


def _meta(n: int, device: torch.device) -> Any:
    from engine.attention.base import AttentionMetadata

    blocks = -(-n // BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=torch.arange(blocks, device=device)[None],
    )


def step_bytes(c: ModelConfig, batch: int, ctx: int, elem: int) -> int:
    """Bytes one decode step reads (see the module docstring)."""
    assert c.mla is not None and c.moe is not None
    m = c.moe
    h = c.hidden_size
    per_expert = 3 * h * m.intermediate_size
    touched = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
    sparse = len(m.sparse_layers)
    dense_mlp = (c.num_layers - sparse) * 3 * h * c.intermediate_size
    moe = sparse * (touched * per_expert + 3 * h * m.shared_intermediate_size + m.num_experts * h)
    params = c.num_layers * (c.attn_params_per_layer + 2 * h) + dense_mlp + moe
    params += c.vocab_size * h  # lm_head (the embedding reads one row per token)
    kv = batch * (ctx + 1) * c.num_layers * c.head_dim * elem
    return int(params * elem + kv)


def active_params(c: ModelConfig) -> int:
    """Parameters one token multiplies by (top-k routed + shared experts, lm_head)."""
    assert c.moe is not None
    m, h = c.moe, c.hidden_size
    sparse = len(m.sparse_layers)
    mlp = (c.num_layers - sparse) * 3 * h * c.intermediate_size
    mlp += sparse * (3 * h * (m.top_k * m.intermediate_size + m.shared_intermediate_size))
    return c.num_layers * c.attn_params_per_layer + mlp + c.vocab_size * h


def time_decode(
    runner: ModelRunner, batch: int, ctx: int, num_blocks: int, device: torch.device, reps: int
) -> float:
    gen = torch.Generator().manual_seed(batch + ctx)
    per_seq = -(-(ctx + 1) // BLOCK)
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

    def step() -> None:
        logits = runner.execute(sched, cast(Any, kv))
        assert logits is not None
        logits.argmax(-1).tolist()

    return timed(step, device, reps, warmup=2) * 1e3


def time_prefill(runner: ModelRunner, new: int, device: torch.device, reps: int) -> float:
    kv = FakeKV({"p": list(range(-(-new // BLOCK)))[::-1]})
    sched = step_of([FakeRequest("p", [11] * new, 0)], [new])
    return timed(lambda: runner.execute(sched, cast(Any, kv)), device, reps, warmup=1)


def bandwidth(device: torch.device) -> float:
    """Device copy GB/s (read + write), the MBU denominator."""
    n = (2 if device.type == "cuda" else 1 / 16) * 1024**3
    src = torch.randn(int(n // 2), device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * 2 / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write report.json here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (a CPU check of the path)")
    ap.add_argument("--cache-gb", type=float, default=60.0)
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else DEEPSEEK_V2_LITE
    dtype = torch.float32 if args.tiny else torch.bfloat16
    report: dict[str, Any] = {"device": str(device), "shape": "tiny" if args.tiny else "V2-Lite"}
    bw = bandwidth(device)
    report["copy_gbps"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)

    check_tiny(device, report)
    t0 = time.perf_counter()
    hf = hf_model(shape, dtype, device)
    model = ours(hf, shape, dtype, device)
    print(f"models built in {time.perf_counter() - t0:.0f} s", flush=True)
    check_big(model, hf, device, report)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()

    c = model.config
    elem = dtype.itemsize
    per_block = BLOCK * c.num_layers * c.head_dim * elem  # one latent part
    num_blocks = int(args.cache_gb * 1e9 // per_block) if not args.tiny else 512
    runner = make_runner(model, num_blocks, device)
    for kv in runner.kv_caches:
        kv.normal_()
    rows = []
    contexts, batches = ((64, 256), (1, 4)) if args.tiny else ((1024, 8192), (1, 32, 128))
    reps = 3 if args.tiny else 20
    for ctx in contexts:
        for batch in batches:
            ms = time_decode(runner, batch, ctx, num_blocks, device, reps)
            mbu = step_bytes(c, batch, ctx, elem) / (ms / 1e3) / (bw * 1e9)
            rows.append({"kind": "decode", "batch": batch, "ctx": ctx, "ms": ms, "mbu": mbu})
            print(f"decode b{batch} ctx{ctx}: {ms:.2f} ms/step, MBU {mbu:.0%}", flush=True)
    new = 256 if args.tiny else 4096
    s = time_prefill(runner, new, device, 2 if args.tiny else 3)
    assert c.mla is not None
    lat, rope = c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
    pairs = new * (new + 1) / 2
    attn = c.num_heads * c.num_layers * pairs * (2 * (lat + rope) + 2 * lat)
    tflops = (2 * active_params(c) * new + attn) / s / 1e12
    rows.append({"kind": "prefill", "new": new, "s": s, "tflops": tflops})
    print(
        f"prefill {new}: {new / s:,.0f} tok/s, {tflops:.1f} TFLOP/s "
        f"({tflops / SPEC_TFLOPS:.1%} of the H200's bf16 spec)",
        flush=True,
    )
    report["rows"] = rows
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

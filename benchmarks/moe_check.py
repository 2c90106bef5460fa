"""The mixture-of-experts expert paths on a Qwen3-30B-A3B-shaped layer: the grouped GEMM
(`torch._grouped_mm` over tokens sorted by expert) against the per-expert loop, checked
for agreement and then timed, at decode-like and prefill-like token counts; then a few
whole layers of the model through the engine's build_model.

    python benchmarks/moe_check.py [--device cuda] [--dtype bfloat16] [--layers 4]
        [--tokens 1,8,64,256,1024,4096] [--iters 20] [--experts 128] [--top-k 8]

Shape (Qwen/Qwen3-30B-A3B's config.json): hidden 2048, 128 experts of intermediate 768,
top-8 softmax routing renormalized, 32 query / 4 KV heads of 128, 48 layers (only
`--layers` are built). Weights are random (seeded), so routing is near uniform: the
timing is of the expert math, not of a trained router's skew. Per token count the table
gives both paths' time per layer, the speed-up, and the max |grouped - loop| relative to
max |loop|; "active bytes" is the expert weights the step touches (each expert that got a
token), and GB/s is that over the grouped time (decode is bound by it).

On a CPU the same script runs at small sizes (`--device cpu --tokens 1,16 --layers 1`) to
check it; the numbers that matter are the GPU's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.attention.base import AttentionMetadata, get_backend
from engine.models.llama import LlamaDecoderLayer
from engine.models.moe import SparseMoeBlock
from engine.models.registry import build_model
from modelinfo.config import model_config_from_hf

# A path that raises is a failed check, not a row to skip: every failure is collected and
# the run exits non-zero after printing the rest of the table.
FAILURES: list[str] = []

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def random_weights(cfg, layers: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """HF-named random weights of the first `layers` layers (std 0.02, router wider)."""
    g = torch.Generator(device=device).manual_seed(0)
    h, moe = cfg.hidden_size, cfg.moe
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * std).to(dtype)

    w = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype, device=device),
        "lm_head.weight": rnd(cfg.vocab_size, h),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        for name, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
            w[p + f"self_attn.{name}_proj.weight"] = rnd(rows, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, hq * d)
        w[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
        w[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
        w[p + "mlp.gate.weight"] = rnd(moe.num_experts, h, std=0.5)
        for e in range(moe.num_experts):
            q = p + f"mlp.experts.{e}."
            w[q + "gate_proj.weight"] = rnd(moe.intermediate_size, h)
            w[q + "up_proj.weight"] = rnd(moe.intermediate_size, h)
            w[q + "down_proj.weight"] = rnd(h, moe.intermediate_size)
    return w


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def bench_block(block: SparseMoeBlock, tokens: list[int], iters: int, device: torch.device):
    moe = block.moe
    per_expert = 3 * moe.intermediate_size * block.w13.shape[2] * block.w13.element_size()
    print(
        f"\nexpert paths, one layer ({moe.num_experts} experts, top-{moe.top_k}, "
        f"intermediate {moe.intermediate_size}, {block.w13.dtype}, {device})"
    )
    print(f"{'tokens':>7} {'grouped ms':>11} {'loop ms':>9} {'speed-up':>9} "
          f"{'rel diff':>9} {'active MB':>10} {'GB/s':>7}")  # fmt: skip
    g = torch.Generator(device=device).manual_seed(1)
    with torch.inference_mode():
        for n in tokens:
            h = torch.randn(n, block.w13.shape[2], generator=g, device=device).to(block.w13.dtype)
            outs, times = {}, {}
            for impl in ("grouped", "loop"):
                block.impl = impl
                try:
                    outs[impl] = block(h)
                    times[impl] = time_ms(lambda h=h: block(h), device, iters)
                except (RuntimeError, NotImplementedError) as e:
                    FAILURES.append(f"{n} tokens, {impl}: {str(e).splitlines()[0]}")
                    print(f"{n:>7} {impl} FAILED (the run will exit non-zero)")
            logits = torch.nn.functional.linear(h.to(block.gate_weight.dtype), block.gate_weight)
            active = int(torch.topk(logits, moe.top_k, dim=-1)[1].unique().numel())
            mb = active * per_expert / 1e6
            if len(times) == 2:
                ref = outs["loop"].float()
                rel = (outs["grouped"].float() - ref).abs().max().item() / ref.abs().max().item()
                gbs = mb / 1e3 / (times["grouped"] / 1e3)
                print(
                    f"{n:>7} {times['grouped']:>11.3f} {times['loop']:>9.3f} "
                    f"{times['loop'] / times['grouped']:>8.2f}x {rel:>9.1e} {mb:>10.1f} {gbs:>7.0f}"
                )


def bench_model(cfg, layers: int, dtype, device: torch.device, tokens: int, iters: int) -> None:
    """A prefill-like step of `tokens` tokens (one sequence) through `layers` whole layers."""
    weights = random_weights(cfg, layers, dtype, str(device))
    backend = get_backend("torch")
    model = build_model(
        cfg, dtype=dtype, device=device, backend=backend, layer_end=layers, weights=weights
    )
    del weights
    block = 16
    blocks = (tokens + block - 1) // block
    caches = [
        torch.zeros(2, blocks, block, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        for _ in range(layers)
    ]
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device)
    pos = torch.arange(tokens, device=device)
    print(f"\nwhole layers: {layers} of the model, one {tokens}-token prefill step")
    for impl in ("grouped", "loop"):
        for layer in model.layers:
            if isinstance(layer, LlamaDecoderLayer) and layer.moe is not None:
                layer.moe.impl = impl

        def step() -> torch.Tensor:
            meta = AttentionMetadata(
                slot_mapping=pos.clone(),
                query_start_loc=[0, tokens],
                seq_lens=[tokens],
                block_tables=torch.arange(blocks, device=device)[None],
            )
            return model(ids, pos, caches, meta, None)

        try:
            ms = time_ms(step, device, iters)
            print(f"  {impl:>8}: {ms:8.2f} ms/step, {ms / layers:7.2f} ms/layer")
        except (RuntimeError, NotImplementedError) as e:
            FAILURES.append(f"{layers} layers, {impl}: {str(e).splitlines()[0]}")
            print(f"  {impl:>8}: FAILED (the run will exit non-zero)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = model_config_from_hf(
        {**QWEN3_30B_A3B, "num_experts": args.experts, "num_experts_per_tok": args.top_k}
    )
    assert cfg.moe is not None
    print(f"torch {torch.__version__}, grouped_mm: {hasattr(torch, '_grouped_mm')}, {device}")
    weights = random_weights(cfg, 1, dtype, args.device)
    block = SparseMoeBlock(cfg, dtype, device)
    missing: list[str] = []
    block.load(weights, "model.layers.0.mlp.", device, missing)
    assert not missing, missing
    del weights
    bench_block(block, [int(t) for t in args.tokens.split(",")], args.iters, device)
    del block
    if args.layers > 0:
        bench_model(cfg, args.layers, dtype, device, args.prefill_tokens, max(1, args.iters // 4))
    if FAILURES:
        sys.exit("moe_check failed:\n  " + "\n  ".join(FAILURES))


if __name__ == "__main__":
    main()

"""The engine on a Qwen3-30B-A3B-shaped random model (MoE with GQA attention, bf16, built
on the device, no download): a check against transformers, then decode MBU and prefill
MFU. The mixture-of-experts counterpart of benchmarks/gpu_engine.py and gpu_mla.py (whose
scheduler stand-ins and timers it reuses).

    python benchmarks/gpu_moe.py [--out DIR] [--cache-gb 40]      # CUDA, bf16
    python benchmarks/gpu_moe.py --device cpu --tiny               # the same path, tiny, CPU

1. Check: a tiny float32 Qwen3-MoE (same family, small dims): the engine's greedy tokens
   (torch backend, grouped experts) == transformers'.
2. The big model's weights are drawn lazily, one tensor at a time as the engine loads it
   (seeded by name; std 0.02, routers wider so that routing is not uniform), so the device
   holds one copy of its 61 GB. Decode ms/step (ModelRunner.execute + argmax, host
   preparation included) and MBU at batch 1 / 32 / 128 over contexts 1K and 8K for each
   attention backend; bytes a step reads: attention and router weights, the routed experts
   the batch touches (expected distinct experts of uniform top-k routing, E (1 - (1 -
   k/E)^B) per layer), lm_head, and every sequence's K and V. Block tables draw blocks at
   random from the cache.
3. Prefill tok/s and MFU of 4K new tokens (2 x activated parameters per token, plus causal
   attention 4 x Hq x D per (query, key) pair).

The grouped expert path sizes its output from the routing (a host sync per layer), so a
MoE model's decode runs without CUDA graphs: these numbers are the eager path's.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_mla import (
    BLOCK,
    SPEC_TFLOPS,
    bandwidth,
    greedy_vs_transformers,
    hub_names,
    time_decode,
    time_prefill,
)
from benchmarks.moe_check import QWEN3_30B_A3B
from engine.attention.base import get_backend
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from modelinfo.config import ModelConfig, model_config_from_hf
from protocol.kv_layout import KVLayout

TINY: dict[str, Any] = {
    **QWEN3_30B_A3B,
    "vocab_size": 4096,
    "hidden_size": 128,
    "head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.2,
}


class RandomWeights(Mapping[str, torch.Tensor]):
    """HF-named random weights of a Qwen3-MoE config, each drawn when the engine reads it
    (a generator seeded by the name: reading twice gives the same tensor)."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        assert c.moe is not None
        self.dtype, self.device = dtype, device
        h, d, m = c.hidden_size, c.head_dim, c.moe
        shapes: dict[str, tuple[tuple[int, ...], float]] = {
            "model.embed_tokens.weight": ((c.vocab_size, h), 0.02),
            "model.norm.weight": ((h,), -1.0),
            "lm_head.weight": ((c.vocab_size, h), 0.02),
        }
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = ((h,), -1.0)
            shapes[p + "post_attention_layernorm.weight"] = ((h,), -1.0)
            for name, rows in (
                ("q", c.num_heads * d),
                ("k", c.num_kv_heads * d),
                ("v", c.num_kv_heads * d),
            ):
                shapes[p + f"self_attn.{name}_proj.weight"] = ((rows, h), 0.02)
            shapes[p + "self_attn.o_proj.weight"] = ((h, c.num_heads * d), 0.02)
            shapes[p + "self_attn.q_norm.weight"] = ((d,), -1.0)
            shapes[p + "self_attn.k_norm.weight"] = ((d,), -1.0)
            shapes[p + "mlp.gate.weight"] = ((m.num_experts, h), 0.5)
            for e in range(m.num_experts):
                q = p + f"mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = ((m.intermediate_size, h), 0.02)
                shapes[q + "up_proj.weight"] = ((m.intermediate_size, h), 0.02)
                shapes[q + "down_proj.weight"] = ((h, m.intermediate_size), 0.02)
        self.shapes = shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, std = self.shapes[name]
        if std < 0:  # a norm weight
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=g, device=self.device) * std).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def runner_for(
    model: LlamaForCausalLM, backend: str, num_blocks: int, device: torch.device
) -> ModelRunner:
    c = model.config
    layout = KVLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[model.dtype],
    )
    b = get_backend(backend)
    for layer in model.layers:
        layer.backend = b  # type: ignore[union-attr]
    return ModelRunner(model, layout, num_blocks, device=device, dtype=model.dtype, backend=b)


def check_tiny(device: torch.device, report: dict[str, Any]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **TINY, attn_implementation="sdpa")
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cfg = model_config_from_hf(TINY)
    model = build_model(
        cfg,
        dtype=torch.float32,
        device=device,
        backend=get_backend("torch"),
        weights=hub_names(dict(hf.state_dict())),
    )
    got, ref = greedy_vs_transformers(hf, runner_for(model, "torch", 128, device), 4096, device)
    report["tiny_fp32_greedy_identical"] = got == ref
    print("tiny float32 Qwen3-MoE greedy tokens == transformers:", got == ref, flush=True)
    assert got == ref, (got, ref)


def step_bytes(c: ModelConfig, batch: int, ctx: int, elem: int) -> int:
    """Bytes one decode step reads (see the module docstring)."""
    assert c.moe is not None
    m, h = c.moe, c.hidden_size
    touched = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
    per_layer = c.attn_params_per_layer + 2 * h + m.num_experts * h
    per_layer += touched * 3 * h * m.intermediate_size
    params = c.num_layers * per_layer + c.vocab_size * h
    kv = batch * (ctx + 1) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    return int(params * elem + kv)


def active_params(c: ModelConfig) -> int:
    assert c.moe is not None
    m, h = c.moe, c.hidden_size
    mlp = 3 * h * m.top_k * m.intermediate_size + m.num_experts * h
    return c.num_layers * (c.attn_params_per_layer + mlp) + c.vocab_size * h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write report.json here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (a CPU check of the path)")
    ap.add_argument("--cache-gb", type=float, default=40.0)
    ap.add_argument("--backends", default="flex,torch")
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else QWEN3_30B_A3B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    report: dict[str, Any] = {"device": str(device), "shape": "tiny" if args.tiny else "30B-A3B"}
    bw = bandwidth(device)
    report["copy_gbps"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    check_tiny(device, report)

    c = model_config_from_hf(shape)
    model = build_model(
        c,
        dtype=dtype,
        device=device,
        backend=get_backend("torch"),
        weights=RandomWeights(c, dtype, device),
    )
    elem = dtype.itemsize
    per_block = BLOCK * c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    num_blocks = 512 if args.tiny else int(args.cache_gb * 1e9 // per_block)
    contexts, batches = ((64, 256), (1, 4)) if args.tiny else ((1024, 8192), (1, 32, 128))
    reps = 3 if args.tiny else 10
    rows = []
    for backend in args.backends.split(","):
        if device.type != "cuda" and backend == "flex":
            continue
        runner = runner_for(model, backend, num_blocks, device)
        for kv in runner.kv_caches:
            kv.normal_()
        for ctx in contexts:
            for batch in batches:
                ms = time_decode(runner, batch, ctx, num_blocks, device, reps)
                mbu = step_bytes(c, batch, ctx, elem) / (ms / 1e3) / (bw * 1e9)
                rows.append(
                    {"kind": "decode", "backend": backend, "batch": batch, "ctx": ctx}
                    | {"ms": ms, "mbu": mbu}
                )
                print(f"{backend} decode b{batch} ctx{ctx}: {ms:.2f} ms/step, MBU {mbu:.0%}")
        new = 256 if args.tiny else 4096
        s = time_prefill(runner, new, device, 2 if args.tiny else 3)
        pairs = new * (new + 1) / 2
        attn = 4 * c.num_heads * c.head_dim * pairs * c.num_layers
        tflops = (2 * active_params(c) * new + attn) / s / 1e12
        rows.append({"kind": "prefill", "backend": backend, "new": new, "s": s, "tflops": tflops})
        print(
            f"{backend} prefill {new}: {new / s:,.0f} tok/s, {tflops:.1f} TFLOP/s "
            f"({tflops / SPEC_TFLOPS:.1%} of the H200's bf16 spec)",
            flush=True,
        )
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["rows"] = rows
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

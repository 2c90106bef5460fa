"""Parallel layouts across GPUs with NCCL give the same greedy tokens as one GPU.

    python benchmarks/parallel_gpu_check.py                 # 2+ GPUs: PP2, TP2 x DCP2, TP2
    python benchmarks/parallel_gpu_check.py --device cpu    # the same over gloo on CPU

Builds a tiny random Llama in a temporary folder (8 query / 4 KV heads, 4 layers; no
download, tokenizer built offline), generates greedily on one device with the
single-process engine (and with transformers as a second reference), then with each
parallel layout, one process per device (engine/parallel/launch.py), and prints a table.
Exit status 0 when every layout matches.

Needs only torch, transformers, numpy, msgspec, xxhash, tokenizers, safetensors, jinja2
and pyyaml: it imports the engine, never the HTTP or transfer layers (no fastapi,
uvicorn or Mooncake). NVLink multicast stays off (NCCL_NVLS_ENABLE=0, as the lent
machines require).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

LAYOUTS = {
    "pp2": {"pp": 2, "layer_split": (3, 1)},
    "tp2dcp2": {"tp": 2, "dcp": 2},
    "tp2": {"tp": 2, "dcp": 1},
}
VOCAB = 4096


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """A random-weight Llama folder (config, safetensors, byte-level BPE tokenizer)."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for sym in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[sym] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # large weights: clear margins between greedy choices
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(
        str(out), safe_serialization=True
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="of: " + ", ".join(LAYOUTS))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.parallel.launch import generate_parallel
    from modelinfo.info import load_model_info
    from protocol.sampling import SamplingParams

    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            print(f"needs 2 GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        devices, backend = ["cuda:0", "cuda:1"], "nccl"
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        devices, backend = ["cpu", "cpu"], "gloo"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 64, 301)]
    rows: list[tuple[str, str, str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-check-") as tmp:
        model = str(build_tiny_model(Path(tmp) / "model"))
        config = EngineConfig(
            device=devices[0],
            dtype=args.dtype,
            block_size=16,
            num_blocks=512,
            max_num_batched_tokens=64,  # the 301-token prompt runs in chunks (pipelined)
            cache_dir=str(Path(tmp) / "cache"),
        )
        t0 = time.perf_counter()
        engine = LLMEngine(load_model_info(model), config)
        want = [c.token_ids for c in engine.generate(prompts, params)]
        rows.append(("single process", devices[0], "-", "reference", time.perf_counter() - t0))
        del engine
        if args.dtype == "float32":
            from transformers import AutoModelForCausalLM

            t0 = time.perf_counter()
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(devices[0])
            same = True
            for p, w in zip(prompts, want, strict=True):
                ids = torch.tensor([p], device=devices[0])
                out = hf.generate(
                    ids, max_new_tokens=len(w), min_new_tokens=len(w), do_sample=False
                )
                same &= out[0, len(p) :].tolist() == w
            rows.append(("transformers", devices[0], "-", _yes(same), time.perf_counter() - t0))
            del hf
        if args.device == "cuda":
            torch.cuda.empty_cache()
        ok = True
        for name in args.layouts.split(","):
            layout = LAYOUTS[name]
            t0 = time.perf_counter()
            try:
                got = generate_parallel(model, config, prompts, params, devices=devices, **layout)  # type: ignore[arg-type]
                result = _yes(got == want)
                ok &= got == want
            except Exception as e:  # report and go on with the other layouts
                result, ok = f"FAILED: {e}".splitlines()[0][:60], False
            rows.append((name, ",".join(devices), backend, result, time.perf_counter() - t0))
    _print_table(rows, prompts, args)
    return 0 if ok else 1


def _yes(same: bool) -> str:
    return "yes" if same else "NO"


def _print_table(rows, prompts, args) -> None:  # type: ignore[no-untyped-def]
    print(
        f"\ntiny Llama (8 query / 4 KV heads, 4 layers, {args.dtype}), {len(prompts)} prompts "
        f"of {[len(p) for p in prompts]} tokens, {args.max_tokens} greedy tokens each"
    )
    head = ("layout", "devices", "backend", "tokens == 1 device", "wall s")
    print(f"{head[0]:<16} {head[1]:<16} {head[2]:<8} {head[3]:<20} {head[4]:>7}")
    for r in rows:
        print(f"{r[0]:<16} {r[1]:<16} {r[2]:<8} {r[3]:<20} {r[4]:>7.1f}")


if __name__ == "__main__":
    sys.exit(main())

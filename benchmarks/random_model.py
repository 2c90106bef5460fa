"""A random-weight Llama-3-8B-shaped model folder, built offline (nothing downloaded), for
GPU benchmarks: 32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, bf16,
and the tests' byte-level tokenizer with 49,152 ids (ChatML template).

    python -m benchmarks.random_model OUT_DIR [--device cuda] [--seed 0]

~25 s on one H200 to build and write 16 GB; a folder that already holds a config and
weights of this shape is kept as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VOCAB = 49152
LLAMA_3_8B = {
    "vocab_size": VOCAB,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build(out: Path, device: str = "cuda", seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import make_tiny_tokenizer  # the tests' offline tokenizer builder

    config_file = out / "config.json"
    if config_file.exists() and any(out.glob("*.safetensors")):
        have = json.loads(config_file.read_text())
        if all(have.get(k) == v for k, v in LLAMA_3_8B.items()):
            return out
    out.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(out, VOCAB)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**LLAMA_3_8B, torch_dtype="bfloat16")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t = time.perf_counter()
    build(args.out, args.device, args.seed)
    print(f"{args.out}: Llama-3-8B-shaped random bf16 model ({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()

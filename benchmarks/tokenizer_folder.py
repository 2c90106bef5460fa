"""A model's tokenizer, chat template and config as a Hugging Face folder without weights,
for a machine that cannot install the model's package (the GPU machine has no package
registry): the router loads its tokenizer from such a folder as from the model itself.
The folder's model.safetensors holds no tensor (a folder must have one to be a model);
an engine cannot serve it.

    python -m benchmarks.tokenizer_folder OUT_DIR [--model builtin:smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

from modelinfo.info import load_model_info


def write(spec: str, out: Path) -> Path:
    info = load_model_info(spec)
    cfg = info.config
    out.mkdir(parents=True, exist_ok=True)
    info.tokenizer.backend.save(str(out / "tokenizer.json"))
    tokenizer_config: dict[str, object] = dict(info.tokenizer.special_tokens)
    if info.chat_template is not None:
        tokenizer_config["chat_template"] = info.chat_template.source()
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    config = {
        "architectures": [cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    header = json.dumps({"__metadata__": {"tensors": "none: a tokenizer-only folder"}}).encode()
    header += b" " * (-len(header) % 8)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = ap.parse_args()
    print(write(args.model, args.out))


if __name__ == "__main__":
    main()

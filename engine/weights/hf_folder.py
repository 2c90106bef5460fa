"""Weights of a Hugging Face model folder: one or many (sharded) *.safetensors files.

Names come back exactly as stored (`model.layers.0.self_attn.q_proj.weight`, ...), in their
stored dtype; the model casts. Tied embeddings need nothing here: checkpoints saved with
tie_word_embeddings omit `lm_head.weight`, and the model reads `model.embed_tokens.weight`
for its lm_head instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from protocol.errors import ModelLoadError

NameFilter = Callable[[str], bool]
"""Selects the tensors to load (e.g. one pipeline stage's layers); None loads all."""


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those listed in model.safetensors.index.json if present
    (shards), else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [folder / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors files; kvserve loads safetensors only "
            "(convert .bin checkpoints first)"
        )
    return files


def load_safetensors(path: Path, want: NameFilter | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file (memory-mapped read, then owned copies on CPU)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {n: f.get_tensor(n) for n in f.keys() if want is None or want(n)}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from None


def load_hf_folder(folder: Path, want: NameFilter | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's safetensors shards, keyed by HF name."""
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        weights.update(load_safetensors(file, want))
    return weights

"""LazyWeights: a checkpoint's tensors read one at a time, for loaders that keep slices.

A decode TP rank keeps only its slice of every matrix (engine/parallel/tp_model.py), yet
`load_weights` hands it every tensor in host memory at once: for a ~220 GB mixture of
experts (GLM-4.5-Air) that is the whole checkpoint per rank, four times on a TP 4 server.
Here the names are indexed up front and each access reads that one tensor from its
memory-mapped file (an owned copy, freed once the caller has sliced it), so a rank's peak
host memory is about one tensor plus its shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.weights.hf_folder import NameFilter
from protocol.errors import ModelLoadError


class LazyWeights(Mapping[str, torch.Tensor]):
    """Owns open handles on safetensors files; maps HF name -> tensor, read on access."""

    def __init__(self, files: list[Path], want: NameFilter | None = None) -> None:
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for path in files:
            for name in self._handle(path).keys():  # noqa: SIM118 (a safe_open, not a dict)
                if want is None or want(name):
                    self._where[name] = path

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from None
            self._handles[path] = handle
        return handle

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]  # KeyError for an absent name, as a dict
        try:
            return self._handle(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read tensor {name} from {path}: {e}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

"""`load_weights`: HF-named tensors from any source, with GGUF converted once and cached.

Dequantizing a GGUF is slow (numpy, seconds to minutes), so the first load writes the
result as one safetensors file and later loads memory-map that instead:

    cache_dir/<gguf stem>-<fingerprint>.safetensors
        fingerprint = blake2b(converter version, file size, first and last 1 MiB)

The fingerprint reads 2 MiB, so it is cheap for any file size, survives copies and
touches, and changes with any re-quantisation. The file is streamed tensor by tensor (peak
memory: one tensor) to a temporary name and renamed into place, so a crash or a
concurrent conversion never leaves a half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from engine.weights.gguf_file import QT, check_gguf_tensors, gguf_to_hf_name, iter_hf_tensors
from engine.weights.hf_folder import (
    NameFilter,
    load_hf_folder,
    load_safetensors,
    safetensors_files,
)
from engine.weights.lazy import LazyWeights
from modelinfo.config import ModelConfig
from modelinfo.gguf_config import GGUFHeader, read_gguf_header
from protocol.errors import ModelLoadError

SourceKind = Literal["hf", "gguf"]
"""As modelinfo.source.ModelSource.kind: an HF folder or a .gguf file."""

DEFAULT_CACHE_DIR = Path("~/.cache/kvserve")
"""Where conversions go when the caller names no cache folder (EngineConfig.cache_dir)."""
CONVERTER_VERSION = b"kvserve-gguf-to-safetensors-v1"
"""Bump when the conversion output changes; old cache files are then ignored."""
_SPAN_BYTES = 1 << 20


def load_weights(
    source_kind: SourceKind | str,
    path: str | os.PathLike[str],
    config: ModelConfig,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    want: NameFilter | None = None,
) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of the model at `path` (`want` selects a subset, e.g. one
    pipeline stage's). A GGUF is converted into `cache_dir` (default DEFAULT_CACHE_DIR)
    on first use; an HF folder is read directly."""
    if source_kind == "hf":
        return load_hf_folder(Path(path), want)
    if source_kind == "gguf":
        folder = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
        return load_safetensors(cached_gguf_conversion(Path(path), config, folder), want)
    raise ValueError(f"unknown weight source kind {source_kind!r}; valid: 'hf', 'gguf'")


def open_weights(
    source_kind: SourceKind | str,
    path: str | os.PathLike[str],
    config: ModelConfig,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    want: NameFilter | None = None,
) -> LazyWeights:
    """As load_weights, but each tensor is read when accessed (engine/weights/lazy.py): for
    loaders that keep only a slice of every tensor (decode TP ranks)."""
    if source_kind == "hf":
        return LazyWeights(safetensors_files(Path(path)), want)
    if source_kind == "gguf":
        folder = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
        return LazyWeights([cached_gguf_conversion(Path(path), config, folder)], want)
    raise ValueError(f"unknown weight source kind {source_kind!r}; valid: 'hf', 'gguf'")


def gguf_fingerprint(path: Path) -> str:
    """32-hex-digit id of a GGUF's content (see the module docstring)."""
    h = hashlib.blake2b(CONVERTER_VERSION, digest_size=16)
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    with path.open("rb") as f:
        h.update(f.read(_SPAN_BYTES))
        f.seek(max(0, size - _SPAN_BYTES))
        h.update(f.read(_SPAN_BYTES))
    return h.hexdigest()


def cached_gguf_conversion(path: Path, config: ModelConfig, cache_dir: Path) -> Path:
    """Path of the safetensors conversion of `path`, converting first if it is not cached."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    target = cache_dir / f"{path.stem}-{gguf_fingerprint(path)}.safetensors"
    if target.is_file():
        return target
    header = read_gguf_header(path)
    check_gguf_tensors(header, config)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create weight cache folder {cache_dir}: {e}") from None
    convert_gguf(header, config, target)
    return target


def _stored_dtype(ggml_type: QT) -> np.dtype:
    """F16 stays F16 (lossless); everything else is stored as the float32 it dequantizes to."""
    return np.dtype("<f2") if ggml_type == QT.F16 else np.dtype("<f4")


def _safetensors_header(header: GGUFHeader) -> tuple[bytes, list[str]]:
    """The safetensors JSON header for the converted tensors, and their GGUF names in
    data order. Shapes and dtypes are known before dequantizing anything."""
    entries: dict[str, object] = {
        "__metadata__": {"format": "pt", "source": os.path.basename(header.path)}
    }
    order: list[str] = []
    offset = 0
    for name, info in header.tensors.items():
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            continue
        dtype = _stored_dtype(info.ggml_type)
        nbytes = dtype.itemsize * math.prod(info.shape)
        entries[hf_name] = {
            "dtype": "F16" if dtype.itemsize == 2 else "F32",
            "shape": list(info.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        order.append(name)
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, order


def convert_gguf(header: GGUFHeader, config: ModelConfig, target: Path) -> None:
    """Dequantize every parameter of `header` into the safetensors file `target`,
    streaming one tensor at a time, with a progress bar on stderr."""
    head, order = _safetensors_header(header)
    expected = {name: i for i, name in enumerate(order)}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    desc = f"Converting {os.path.basename(header.path)} (once; cached in {target.parent})"
    try:
        with tmp.open("wb") as out, tqdm(total=len(order), desc=desc, file=sys.stderr) as bar:
            out.write(head)
            for done, (_, info, array) in enumerate(iter_hf_tensors(header, config)):
                assert expected[info.name] == done  # data order must match the header's offsets
                out.write(array.astype(_stored_dtype(info.ggml_type), copy=False).tobytes())
                bar.update(1)
        os.replace(tmp, target)
    except OSError as e:
        raise ModelLoadError(f"cannot write the converted weights to {target}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)

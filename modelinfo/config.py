"""ModelConfig: the architecture hyper-parameters the engine needs, from any weight format."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import ModelLoadError


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """RoPE scaling as Hugging Face's `rope_scaling` describes it.

    kind: "default" (none), "linear" (positions divided by factor) or "llama3"
    (frequency-dependent scaling of Llama 3.1+).
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

    architecture: str
    """Hugging Face architecture name, e.g. "LlamaForCausalLM"; picks the implementation."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama with attention_bias=True)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )


_QK_NORM_ARCHS = {"Qwen3ForCausalLM"}
_BIAS_ARCHS = {"Qwen2ForCausalLM"}


def _rope_scaling_from_hf(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3"
        )
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; cannot pick a model")
    arch = archs[0]
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers >= 5 writes RoPE settings only under "rope_parameters" (theta and
        # scaling together); older configs use top-level rope_theta / rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(rope or cfg.get("rope_scaling")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch in _BIAS_ARCHS)),
            qk_norm=arch in _QK_NORM_ARCHS,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None

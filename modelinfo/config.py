"""ModelConfig: the architecture hyper-parameters the engine needs, from any weight format."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from protocol.errors import ModelLoadError, UnsupportedArchitectureError


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """RoPE scaling as Hugging Face's `rope_scaling` describes it.

    kind: "default" (none), "linear" (positions divided by factor), "llama3"
    (frequency-dependent scaling of Llama 3.1+) or "yarn" (NTK-by-parts interpolation with
    an attention factor on cos/sin; DeepSeek-V2/V3).
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    """yarn: the rotation counts bounding the interpolated band of dims."""
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    """yarn: DeepSeek's attention-factor terms (0 = absent)."""
    attention_factor: float | None = None
    """yarn: the factor on cos/sin; None derives it from factor, mscale, mscale_all_dim."""
    truncate: bool = True
    """yarn: round the band's bounds to whole dims."""


class MoeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The mixture-of-experts feed-forward of a model (docs/models.md has the math).

    A sparse layer's MLP routes every token to `top_k` of `num_experts` SwiGLU experts and
    sums their outputs weighted by the router; a shared expert (Glm4Moe) sees every token.
    Layers not in `sparse_layers` keep the dense MLP of `ModelConfig.intermediate_size`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    """Intermediate size of one routed expert (`moe_intermediate_size`)."""
    scoring: str
    """"softmax" (Qwen3-MoE: softmax over all experts, then top-k) or "sigmoid" (Glm4Moe:
    sigmoid scores, top-k chosen on scores + e_score_correction_bias within the best
    groups, weighted by the uncorrected scores)."""
    norm_topk_prob: bool
    """Renormalize the k chosen weights to sum to 1."""
    num_groups: int = 1
    topk_groups: int = 1
    """Grouped top-k (sigmoid scoring): experts split into `num_groups` groups, only the
    `topk_groups` groups with the best top-2 score sums are eligible."""
    group_score: str = "top2_sum"
    """How a group of experts scores for grouped top-k: "top2_sum" (the sum of its best
    two choice scores; Glm4Moe, DeepSeek-V3) or "max" (its best softmax score;
    DeepSeek-V2's group_limited_greedy)."""
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    """Intermediate size of the shared expert (n_shared_experts x moe_intermediate_size);
    0 for none."""
    router_float32: bool = False
    """Router logits computed in float32 whatever the model dtype (Glm4Moe keeps its gate
    weight and score bias in float32)."""
    sparse_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is the mixture of experts."""

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"MoE scoring {self.scoring!r} is not softmax or sigmoid")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ModelLoadError(
                f"n_group ({self.num_groups}) must divide the {self.num_experts} experts"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ModelLoadError(f"topk_group ({self.topk_groups}) must be in [1, n_group]")
        if self.group_score not in ("top2_sum", "max"):
            raise ModelLoadError(f"MoE group score {self.group_score!r} is not top2_sum or max")
        if (
            self.group_score == "top2_sum"
            and self.num_groups > 1
            and self.num_experts // self.num_groups < 2
        ):
            raise ModelLoadError("grouped top-k needs at least 2 experts per group")


class MlaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-head latent attention (DeepSeek-V2/V3; docs/models.md has the math).

    Per token, the KV is one latent c (kv_lora_rank, RMS-normed) plus a rotated key part
    k_pe (qk_rope_head_dim) shared by every head; head h's key is (W_UK[h] c, k_pe) and its
    value W_UV[h] c. The cache keeps (c, k_pe): ModelConfig.num_kv_heads is 1 and
    ModelConfig.head_dim kv_lora_rank + qk_rope_head_dim for an MLA model.
    """

    q_lora_rank: int | None
    """Rank of the low-rank query projection (q_a_proj, q_a_layernorm, q_b_proj); None
    for a plain q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(factor, mscale_all_dim)^2
    under yarn RoPE (transformers' yarn_apply_mscale)."""
    rope_interleave: bool = True
    """The rotary dims are (x0, x1), (x2, x3), ... pairs (DeepSeek's layout; V2 always,
    V3 unless rope_interleave is false, then rotate-half)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements of one cached token of one layer: latent + rope part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Hyper-parameters of a decoder of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3,
    SmolLM2) or of its mixture-of-experts relatives (Qwen3-MoE, Glm4Moe)."""

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
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first head_dim x factor dims of each head, the rest pass (Glm4Moe)."""
    moe: MoeConfig | None = None
    """The mixture-of-experts MLP, None for a dense model."""
    mla: MlaConfig | None = None
    """Multi-head latent attention (DeepSeek-V2/V3) instead of q/k/v heads; then
    num_kv_heads is 1 and head_dim the cached latent's width (MlaConfig)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.mla is not None:
            if self.num_kv_heads != 1 or self.head_dim != self.mla.latent_dim:
                raise ModelLoadError("an MLA model caches one latent head of latent_dim")
            if self.mla.qk_rope_head_dim % 2:
                raise ModelLoadError("qk_rope_head_dim must be even")
            return
        rot = self.rotary_dim
        if not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ModelLoadError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives {rot} rotary dims "
                f"of head_dim {self.head_dim}; need an even count in [2, head_dim]"
            )

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates (as transformers computes it);
        an MLA model rotates the qk_rope_head_dim part."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_kind(self) -> str:
        """protocol.kv_layout's KV kind: "mla" (one latent entry) or "mha" (K and V)."""
        return "mha" if self.mla is None else "mla"

    @property
    def attn_params_per_layer(self) -> int:
        """Attention projection parameters of one layer (memory budgets)."""
        h = self.hidden_size
        m = self.mla
        if m is None:
            return h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        q = self.num_heads * m.qk_head_dim
        q_params = h * q if m.q_lora_rank is None else m.q_lora_rank * (h + q + 1)
        kv = h * m.latent_dim + m.kv_lora_rank
        kv += m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q_params + kv + self.num_heads * m.v_head_dim * h

    @property
    def mlp_params_per_layer(self) -> int:
        """MLP parameters of a layer, averaged over the layers, every expert counted (what
        memory budgets need; 3 x hidden x intermediate for a dense model)."""
        h, dense = self.hidden_size, 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return dense
        m = self.moe
        sparse = m.num_experts * (3 * h * m.intermediate_size + h)  # experts + router row
        sparse += 3 * h * m.shared_intermediate_size
        num_sparse = len(m.sparse_layers)
        total = num_sparse * sparse + (self.num_layers - num_sparse) * dense
        return -(-total // self.num_layers)  # rounded up

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers


SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""config.json `architectures[0]` values the engine builds (engine/models/registry.py maps
each to its class; a test keeps the two equal). Torch-free, so `kvserve check` can refuse a
model before any worker starts."""


def check_architecture(arch: str) -> None:
    """UnsupportedArchitectureError naming the supported architectures unless `arch` is one."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"model architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


_QK_NORM_ARCHS = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
_BIAS_ARCHS = {"Qwen2ForCausalLM"}


_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def _rope_scaling_from_hf(raw: dict[str, Any] | None, max_positions: int) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported; supported: {', '.join(_ROPE_KINDS)}"
        )
    original = int(raw.get("original_max_position_embeddings", 8192))
    factor = raw.get("factor")
    if factor is None:  # transformers' yarn: the ratio of the context lengths
        factor = max_positions / original if kind == "yarn" else 1.0
    attention_factor = raw.get("attention_factor")
    return RopeScaling(
        kind=kind,
        factor=float(factor),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        mscale=float(raw.get("mscale") or 0.0),
        mscale_all_dim=float(raw.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(raw.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


_MLA_ARCHS = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def _mla_from_hf(arch: str, cfg: dict[str, Any], rope: RopeScaling) -> MlaConfig | None:
    """The MLA section of a DeepSeek-V2/V3 config.json (defaults as transformers')."""
    if arch not in _MLA_ARCHS:
        return None
    v3 = arch == "DeepseekV3ForCausalLM"
    nope = int(cfg.get("qk_nope_head_dim", 128))
    rope_dim = int(cfg.get("qk_rope_head_dim", 64))
    scale = (nope + rope_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    q_lora = cfg.get("q_lora_rank", 1536)
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg.get("v_head_dim") or 128),
        softmax_scale=scale,
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; cannot pick a model")
    arch = archs[0]
    check_architecture(arch)
    quant = cfg.get("quantization_config")
    if quant:
        # e.g. DeepSeek-V3's fp8 block-quantized weights: read as plain tensors they would
        # load without their scales and compute garbage; refuse instead.
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelLoadError(
            f"quantized checkpoints (quantization_config quant_method {method!r}) are not "
            "supported; use a bfloat16 / float32 checkpoint of the model"
        )
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers >= 5 writes RoPE settings only under "rope_parameters" (theta and
        # scaling together); older configs use top-level rope_theta / rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        rope_scaling = _rope_scaling_from_hf(rope or cfg.get("rope_scaling"), max_positions)
        mla = _mla_from_hf(arch, cfg, rope_scaling)
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if mla is not None:  # the cache holds one latent "head" (MlaConfig)
            num_kv_heads, head_dim = 1, mla.latent_dim
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch in _BIAS_ARCHS)),
            qk_norm=bool(cfg.get("use_qk_norm", arch in _QK_NORM_ARCHS)),
            partial_rotary_factor=_partial_rotary_factor(arch, cfg, rope),
            moe=_moe_from_hf(arch, cfg),
            mla=mla,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None


def _partial_rotary_factor(arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> float:
    # transformers' Glm4MoeConfig defaults the factor to 0.5 when config.json omits it.
    default = 0.5 if arch == "Glm4MoeForCausalLM" else 1.0
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> MoeConfig | None:
    """The MoE section of a Qwen3-MoE or Glm4Moe config.json (defaults as transformers')."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "Qwen3MoeForCausalLM":
        # transformers 5 writes the expert count as num_local_experts; the Hub's configs
        # (transformers 4) as num_experts (Qwen3-MoE) or n_routed_experts (Glm4Moe).
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(
            i
            for i in range(layers)
            if i not in dense and num_experts > 0 and step > 0 and (i + 1) % step == 0
        )
        if num_experts == 0:
            return None
        return MoeConfig(
            num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
            scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )
    if arch == "Glm4MoeForCausalLM":
        inter = int(cfg.get("moe_intermediate_size", 1408))
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        return MoeConfig(
            num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 128))),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=inter,
            scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            num_groups=int(cfg.get("n_group", 1)),
            topk_groups=int(cfg.get("topk_group", 1)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=inter * int(cfg.get("n_shared_experts", 1)),
            router_float32=True,
            sparse_layers=tuple(range(first_dense, layers)),
        )
    if arch in _MLA_ARCHS:
        return _deepseek_moe_from_hf(arch, cfg, layers)
    return None


def _deepseek_moe_from_hf(arch: str, cfg: dict[str, Any], layers: int) -> MoeConfig | None:
    """DeepSeek-V2 (softmax; greedy or group_limited_greedy top-k, never renormalized) and
    V3 (sigmoid + e_score_correction_bias, grouped top-k, as Glm4Moe); layers from
    first_k_dense_replace on are sparse, each with n_shared_experts shared experts."""
    num_experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 64)))
    if num_experts == 0:
        return None
    inter = int(cfg.get("moe_intermediate_size", 1407))
    v3 = arch == "DeepseekV3ForCausalLM"
    method = cfg.get("topk_method") or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(
            f"topk_method {method!r} is not supported; supported: greedy, group_limited_greedy"
        )
    grouped = v3 or method == "group_limited_greedy"
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(cfg.get("num_experts_per_tok") or 8),
        intermediate_size=inter,
        scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)) if v3 else False,
        num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
        router_float32=True,
        sparse_layers=tuple(range(int(cfg.get("first_k_dense_replace", 0)), layers)),
    )

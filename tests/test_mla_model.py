"""DeepSeek-V2/V3 (multi-head latent attention + their mixtures of experts) against
transformers in float32: logits and greedy tokens through the paged engine path with both
torch backends, the weight absorption against transformers' expanded attention, YaRN,
the routers, config parsing of the Hub's DeepSeek-V2-Lite config, and the KV bytes an MLA
model costs (one latent entry per token and layer).

`make_tiny_deepseek` is the tiny random DeepSeek folder the parallel and end-to-end MLA
tests share.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from test_model_vs_transformers import PagedRunner, assert_logits_close, hf_greedy
from test_moe_model import check_router

from engine.attention.base import get_backend
from engine.models.registry import build_model
from engine.rope import attention_factor, compute_inv_freq
from engine.weights.cache import load_weights
from kvserve.launcher import check
from modelinfo.config import model_config_from_hf
from protocol.cluster_types import format_bytes
from protocol.errors import ModelLoadError
from protocol.kv_layout import KVLayout

TINY_DEEPSEEK: dict[str, dict[str, object]] = {
    # q through a low-rank q_a/q_b pair; softmax routing over 4 groups of which 2 stay
    # eligible (group_limited_greedy), scaled weights; YaRN with mscale != mscale_all_dim
    # (an attention factor on cos/sin and a changed softmax scale).
    "deepseek_v2": dict(
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
    ),
    # A plain q_proj (V2-Lite's shape); sigmoid routing with a correction bias, grouped
    # top-k, renormalized, scaled.
    "deepseek_v3": dict(
        q_lora_rank=None,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}

_ARCH = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def make_tiny_deepseek(
    folder: Path,
    arch: str = "deepseek_v2",
    tokenizer_dir: Path | None = None,
    *,
    vocab_size: int = 512,
    seed: int = 0,
    **overrides: object,
):
    """Save a tiny random `arch` ("deepseek_v2" / "deepseek_v3") model in `folder` (with
    the tokenizer files of `tokenizer_dir` if given) and return the transformers model.
    4 heads (TP 2 x DCP 2 splits them), 3 layers of which layer 0 is dense, a shared
    expert; router weights and the V3 score bias randomized so routing matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=4096,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **TINY_DEEPSEEK[arch],
    )
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.5)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer_dir is not None:
        for f in os.listdir(tokenizer_dir):
            shutil.copy(tokenizer_dir / f, folder / f)
    return model


def _config(folder: Path):
    return model_config_from_hf(json.loads((folder / "config.json").read_text()))


def _build(folder: Path, backend: str = "torch", dtype: torch.dtype = torch.float32):
    config = _config(folder)
    weights = load_weights("hf", folder, config)
    return build_model(
        config, dtype=dtype, device="cpu", backend=get_backend(backend), weights=weights
    )


@pytest.mark.parametrize("backend", ["torch", "torch_lse"])
@pytest.mark.parametrize("arch", sorted(TINY_DEEPSEEK))
def test_tiny_deepseek_matches_transformers(arch: str, backend: str, tmp_path: Path) -> None:
    """Prefill of three prompts in one flat batch (logits within 1e-4 of transformers'),
    then greedy decode over the latent cache (absorbed weights) picks transformers'
    tokens."""
    hf = make_tiny_deepseek(tmp_path, arch)
    model = _build(tmp_path, backend)
    assert [layer.moe is not None for layer in model.layers] == [False, True, True]
    assert all(layer.mla is not None for layer in model.layers)
    gen = random.Random(1)
    prompts = [[gen.randrange(512) for _ in range(n)] for n in (5, 17, 40)]
    runner = PagedRunner(model)
    assert runner.kv_caches[0].shape[0] == 1 and runner.kv_caches[0].shape[-1] == 32 + 8
    logits = runner.step(dict(enumerate(prompts)))
    rows = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert_logits_close(logits[rows : rows + len(p)], ref)
        rows += len(p)
    ours, _ = PagedRunner(model, seed=2).greedy(prompts, 16)
    for p, o in zip(prompts, ours, strict=True):
        assert o == hf_greedy(hf, p, 16)


def test_decode_steps_match_transformers_logits(tmp_path: Path) -> None:
    """Token-by-token decode (q_len 1 rows over the cached latent, behind a prefix) gives
    transformers' full-sequence logits at every position, not only the same argmax."""
    hf = make_tiny_deepseek(tmp_path, "deepseek_v2")
    model = _build(tmp_path)
    seq = [random.Random(3).randrange(512) for _ in range(30)]
    runner = PagedRunner(model)
    got = [runner.step({0: seq[:10]})]
    got += [runner.step({0: [t]}) for t in seq[10:]]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    assert_logits_close(torch.cat(got), ref)


def test_bfloat16_deepseek_stays_close(tmp_path: Path) -> None:
    hf = make_tiny_deepseek(tmp_path, "deepseek_v2")
    model = _build(tmp_path, dtype=torch.bfloat16)
    prompt = list(range(10, 50))
    logits = PagedRunner(model).step({0: prompt})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_yarn_matches_transformers(tmp_path: Path) -> None:
    """inv_freq and the cos/sin attention factor of YaRN as transformers computes them,
    with DeepSeek's mscale terms, and the MLA softmax scale (mscale_all_dim squared)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    make_tiny_deepseek(tmp_path, "deepseek_v2")
    hf_cfg = AutoConfig.from_pretrained(tmp_path)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    config = _config(tmp_path)
    assert config.mla is not None and config.rotary_dim == 8
    got = compute_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(got, want_inv)
    assert attention_factor(config.rope_scaling) == pytest.approx(want_factor, rel=1e-12)
    assert want_factor != 1.0  # mscale 1.0 vs mscale_all_dim 0.8
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    att = DeepseekV2Attention(hf_cfg, 0)
    assert config.mla.softmax_scale == pytest.approx(att.scaling, rel=1e-12)


def test_routers_match_transformers() -> None:
    """route() against DeepSeek-V2's (softmax, greedy and group-limited) and V3's (sigmoid
    + bias, grouped) router modules on many tokens, compared as per-token weight sets."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    x = torch.randn(300, 64)
    cases = [
        ("deepseek_v2", DeepseekV2TopkRouter, {"topk_method": "greedy"}),
        ("deepseek_v2", DeepseekV2TopkRouter, {}),
        ("deepseek_v3", DeepseekV3TopkRouter, {}),
    ]
    for arch, cls, extra in cases:
        kw = {**TINY_DEEPSEEK[arch], "n_routed_experts": 16, **extra}
        cfg = AutoConfig.for_model(
            arch, hidden_size=64, num_experts_per_tok=3, moe_intermediate_size=8, **kw
        )
        check_router(cls(cfg), cfg, _ARCH[arch], x)


# The Hub's config.json of DeepSeek-V2-Lite (fields the engine reads).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_hub_config_parses_and_kv_bytes_are_the_latent() -> None:
    """DeepSeek-V2-Lite: one latent head of 512 + 64; 576 elements per token per layer
    (1,152 bytes in bf16, 576 in FP8), against 2 x 16 x 192 for expanded K/V; its
    parameters come to the published ~15.7B."""
    c = model_config_from_hf(DEEPSEEK_V2_LITE)
    assert c.mla is not None and c.kv_kind == "mla"
    assert (c.num_kv_heads, c.head_dim, c.rotary_dim) == (1, 576, 64)
    assert c.mla.q_lora_rank is None and c.mla.v_head_dim == 128
    assert c.rope_scaling.kind == "yarn" and c.rope_scaling.factor == 40
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert c.mla.softmax_scale == pytest.approx(192**-0.5 * m * m)
    assert c.moe is not None and c.moe.scoring == "softmax" and not c.moe.norm_topk_prob
    assert c.moe.sparse_layers == tuple(range(1, 27))
    assert c.moe.shared_intermediate_size == 2 * 1408
    for dtype, per_layer in (("bfloat16", 1152), ("float8_e4m3fn", 576)):
        layout = KVLayout(
            num_layers=27, num_kv_heads=1, head_dim=576, block_size=16, dtype=dtype, kind="mla"
        )
        assert layout.bytes_per_token_per_layer == per_layer
        assert layout.cache_shape(3) == (1, 3, 16, 1, 576)
    total = c.num_layers * (c.attn_params_per_layer + c.mlp_params_per_layer)
    total += 2 * c.vocab_size * c.hidden_size
    assert 15.5e9 < total < 16e9, total
    with pytest.raises(ValueError, match="one latent head"):
        KVLayout(
            num_layers=1, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32", kind="mla"
        )
    with pytest.raises(ModelLoadError, match="topk_method"):
        model_config_from_hf({**DEEPSEEK_V2_LITE, "topk_method": "noaux"})
    # DeepSeek-V3's own checkpoint: fp8 block-quantized weights with scales
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ModelLoadError, match="quant_method 'fp8'"):
        model_config_from_hf({**DEEPSEEK_V2_LITE, "quantization_config": fp8})


def test_flex_backend_refuses_mla(tmp_path: Path) -> None:
    make_tiny_deepseek(tmp_path, "deepseek_v2")
    with pytest.raises(ModelLoadError, match="does not run MLA"):
        _build(tmp_path, "flex")


def test_missing_latent_weight_is_named(tmp_path: Path) -> None:
    make_tiny_deepseek(tmp_path, "deepseek_v2")
    config = _config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    del weights["model.layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        build_model(
            config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
        )


def test_kvserve_check_counts_the_latent(tmp_path: Path) -> None:
    """`kvserve check` on DeepSeek-V2-Lite's config with decode TP 2 x DCP 2: the layouts
    line names the latent, and a rank's landing need is its stripe of the whole latent
    (27 layers x 576 x 4 bytes in float32 per token), not 2 x heads x head_dim."""
    repo = Path(__file__).resolve().parents[1]
    example = yaml.safe_load((repo / "deploy/examples/local-pd.yaml").read_text())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")  # only config.json is read
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    example["model"] = str(folder)
    example["dtype"] = "float32"  # the example runs bf16; the byte count below is float32's
    example["decode"][0].update(
        tensor_parallel=2, decode_context_parallel=2, devices=["cpu"] * 2, landing_memory="8GiB"
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(example))
    out = io.StringIO()
    assert check(path, out) == 0
    text = out.getvalue()
    assert "27 layers, 16 query heads over an MLA latent of 576 per token" in text
    per_rank = 163840 // 2 * 27 * 576 * 4
    assert f"is {format_bytes(per_rank)} per rank" in text, text

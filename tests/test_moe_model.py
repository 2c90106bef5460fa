"""Mixture-of-experts models (Qwen3-MoE, Glm4Moe) against transformers in float32, their
config parsing on the Hub's config.json shapes, the router and both expert paths, and
`kvserve check` refusing architectures the engine cannot build.

`make_tiny_moe` is the tiny random MoE folder the parallel and end-to-end MoE tests share.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from test_model_vs_transformers import PagedRunner, assert_logits_close, hf_greedy

from engine.attention.base import get_backend
from engine.models.moe import SparseMoeBlock
from engine.models.moe_experts import experts_grouped, experts_loop
from engine.models.moe_router import route
from engine.models.registry import build_model, supported_architectures
from engine.weights.cache import load_weights
from kvserve.launcher import check
from modelinfo.config import SUPPORTED_ARCHITECTURES, model_config_from_hf
from protocol.config_errors import ConfigError
from protocol.errors import UnsupportedArchitectureError

REPO = Path(__file__).resolve().parents[1]

TINY_MOE = {
    # Softmax routing, top-2 of 8, renormalized; layer 1 dense (mlp_only_layers); q/k norm.
    "qwen3_moe": dict(
        num_experts=8, norm_topk_prob=True, head_dim=32, rope_theta=1e6, mlp_only_layers=[1]
    ),
    # Sigmoid scores + correction bias, 4 groups of which 2 stay eligible, scaling 2.5,
    # a shared expert, layer 0 dense, half the head dims rotary, q/k/v bias and q/k norm.
    "glm4_moe": dict(
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        n_shared_experts=1,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=32,
        partial_rotary_factor=0.5,
        rope_theta=1e6,
    ),
}


def make_tiny_moe(
    folder: Path,
    arch: str,
    tokenizer_dir: Path | None = None,
    *,
    vocab_size: int = 512,
    seed: int = 0,
    **overrides: object,
):
    """Save a tiny random `arch` ("qwen3_moe" / "glm4_moe") model in `folder` (with the
    tokenizer files of `tokenizer_dir` if given) and return the transformers model.
    Weights are large (clear greedy margins); the Glm4Moe score bias and q/k/v biases,
    zero at init, are randomized so they matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **TINY_MOE[arch],
    )
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.5)
            att = layer.self_attn
            if att.q_proj.bias is not None:
                for proj in (att.q_proj, att.k_proj, att.v_proj):
                    proj.bias.normal_(0, 0.5)
            if getattr(att, "q_norm", None) is not None:
                att.q_norm.weight.uniform_(0.5, 1.5)
                att.k_norm.weight.uniform_(0.5, 1.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer_dir is not None:
        for f in os.listdir(tokenizer_dir):
            shutil.copy(tokenizer_dir / f, folder / f)
    return model


def _config(folder: Path):
    return model_config_from_hf(json.loads((folder / "config.json").read_text()))


def _build(folder: Path, dtype: torch.dtype = torch.float32, impl: str | None = None):
    config = _config(folder)
    weights = load_weights("hf", folder, config)
    model = build_model(
        config, dtype=dtype, device="cpu", backend=get_backend("torch"), weights=weights
    )
    if impl is not None:
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.impl = impl
    return model


@pytest.mark.parametrize("impl", ["loop", "grouped"])
@pytest.mark.parametrize("arch", sorted(TINY_MOE))
def test_tiny_moe_matches_transformers(arch: str, impl: str, tmp_path: Path) -> None:
    hf = make_tiny_moe(tmp_path, arch)
    model = _build(tmp_path, impl=impl)
    sparse = [layer.moe is not None for layer in model.layers]
    assert sparse == ([True, False, True] if arch == "qwen3_moe" else [False, True, True])
    gen = random.Random(1)
    prompts = [[gen.randrange(512) for _ in range(n)] for n in (5, 17, 40)]
    logits = PagedRunner(model).step(dict(enumerate(prompts)))
    rows = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert_logits_close(logits[rows : rows + len(p)], ref)
        rows += len(p)
    ours, _ = PagedRunner(model, seed=2).greedy(prompts, 16)
    for p, o in zip(prompts, ours, strict=True):
        assert o == hf_greedy(hf, p, 16)


def test_bfloat16_moe_stays_close(tmp_path: Path) -> None:
    """bf16 weights and KV (the Glm4Moe router still in float32) stay near float32."""
    hf = make_tiny_moe(tmp_path, "glm4_moe")
    model = _build(tmp_path, torch.bfloat16)
    block = model.layers[1].moe
    assert block is not None and block.gate_weight.dtype == torch.float32
    assert block.w13.dtype == torch.bfloat16
    prompt = list(range(10, 50))
    logits = PagedRunner(model).step({0: prompt})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    # Routing is discrete: a near tie can pick another expert in bf16, so compare the
    # greedy choices of most positions rather than every logit.
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_routers_match_transformers() -> None:
    """route() against transformers' router modules on many tokens: softmax top-k, and
    sigmoid grouped top-k where the correction bias and group masking change choices."""
    from transformers import AutoConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(300, 64)
    for arch, cls in (("qwen3_moe", Qwen3MoeTopKRouter), ("glm4_moe", Glm4MoeTopkRouter)):
        kw = {**TINY_MOE[arch], "n_routed_experts": 16, "num_experts": 16, "n_group": 4}
        cfg = AutoConfig.for_model(
            arch, hidden_size=64, num_experts_per_tok=3, moe_intermediate_size=8, **kw
        )
        check_router(cls(cfg), cfg, _ARCH[arch], x)


def check_router(ref: torch.nn.Module, cfg, architecture: str, x: torch.Tensor) -> None:
    """route() gives transformers' router module `ref` (weights and any correction bias
    drawn here) the same per-token expert weights on `x`, compared as sets per token
    (top-k order is not part of the result)."""
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        bias = getattr(ref, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.3)
        _, want_w, want_ids = ref(x)
    config = model_config_from_hf({**cfg.to_dict(), "architectures": [architecture]})
    assert config.moe is not None
    got_w, got_ids = route(x @ ref.weight.T, config.moe, bias)
    experts = ref.weight.shape[0]
    want = torch.zeros(len(x), experts).scatter_(1, want_ids, want_w.float())
    got = torch.zeros(len(x), experts).scatter_(1, got_ids, got_w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_loop_experts_agree(dtype: torch.dtype) -> None:
    """Experts that get no token, one, or many; both paths sum in the same order."""
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 6, 32, 16, 40, 2
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = torch.randn(e, 2 * i, h, generator=g).to(dtype) / 4
    w2 = torch.randn(e, h, i, generator=g).to(dtype) / 4
    ids = torch.randint(0, e - 2, (t, k), generator=g)  # experts 4 and 5 idle
    ids[0] = torch.tensor([5, 0])  # ... but expert 5 gets one row
    weights = torch.rand(t, k, generator=g)
    loop = experts_loop(x, ids, weights, w13, w2)
    grouped = experts_grouped(x, ids, weights, w13, w2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, loop, rtol=tol, atol=tol)
    # The loop against the definition, token by token.
    ref = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            gate, up = (x[tok].float() @ w13[ids[tok, j]].float().T).chunk(2)
            ref[tok] += (
                weights[tok, j] * (torch.nn.functional.silu(gate) * up) @ w2[ids[tok, j]].float().T
            )
    torch.testing.assert_close(loop.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_expert_shards_sum_to_the_whole_block(tmp_path: Path, tp: int) -> None:
    """Each TP rank holds a slice of every expert's intermediate dim (3 ranks: uneven
    slices of 48); the ranks' partial outputs sum to the unsharded block's."""
    make_tiny_moe(tmp_path, "glm4_moe")
    config = _config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    cpu = torch.device("cpu")

    def block(rank: int, size: int) -> SparseMoeBlock:
        b = SparseMoeBlock(config, torch.float32, cpu, tp_rank=rank, tp_size=size)
        missing: list[str] = []
        b.load(weights, "model.layers.2.mlp.", cpu, missing)
        assert not missing
        return b

    h = torch.randn(25, 64, generator=torch.Generator().manual_seed(4))
    whole = block(0, 1)(h)
    parts = sum(block(r, tp)(h) for r in range(tp))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


# The Hub's config.json of the two families' flagship models (fields the engine reads).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": False,
    "vocab_size": 151552,
}


def test_hub_configs_parse() -> None:
    q = model_config_from_hf(QWEN3_30B_A3B)
    assert q.qk_norm and not q.attention_bias and q.rotary_dim == 128
    assert q.moe is not None and q.moe.scoring == "softmax" and q.moe.norm_topk_prob
    assert (q.moe.num_experts, q.moe.top_k, q.moe.intermediate_size) == (128, 8, 768)
    assert q.moe.sparse_layers == tuple(range(48)) and q.moe.shared_intermediate_size == 0
    g = model_config_from_hf(GLM_45_AIR)
    assert g.attention_bias and not g.qk_norm and g.rotary_dim == 64
    assert g.moe is not None and g.moe.scoring == "sigmoid" and g.moe.router_float32
    assert (g.moe.num_experts, g.moe.top_k, g.moe.shared_intermediate_size) == (128, 8, 1408)
    assert g.moe.sparse_layers == tuple(range(1, 46)) and not g.is_sparse_layer(0)
    # transformers' Glm4MoeConfig default when the file omits the factor.
    no_factor = {k: v for k, v in GLM_45_AIR.items() if k != "partial_rotary_factor"}
    assert model_config_from_hf(no_factor).rotary_dim == 64
    with pytest.raises(Exception, match="n_group"):
        model_config_from_hf({**GLM_45_AIR, "n_group": 3})


def test_registry_and_modelinfo_agree_and_refuse_unknown() -> None:
    assert supported_architectures() == sorted(SUPPORTED_ARCHITECTURES)
    with pytest.raises(UnsupportedArchitectureError, match=r"Glm4MoeForCausalLM.*Qwen3Moe"):
        model_config_from_hf({**QWEN3_30B_A3B, "architectures": ["GptOssForCausalLM"]})


def test_kvserve_check_refuses_an_unbuildable_architecture(tmp_path: Path) -> None:
    example = yaml.safe_load((REPO / "deploy/examples/local.yaml").read_text())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")  # only config.json is read
    (folder / "config.json").write_text(
        json.dumps({**GLM_45_AIR, "architectures": ["GptOssForCausalLM"]})
    )
    example["model"] = str(folder)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(example))
    with pytest.raises(ConfigError) as e:
        check(path, io.StringIO())
    assert e.value.path == "model"
    assert "GptOssForCausalLM" in e.value.message and "Glm4MoeForCausalLM" in e.value.message
    # GLM-4.5-Air's config passes, and the GPU examples that serve it fit its layers and heads.
    (folder / "config.json").write_text(json.dumps(GLM_45_AIR))
    for name in ("single-server-8gpu.yaml", "four-server.yaml"):
        text = (REPO / "deploy/examples" / name).read_text()
        assert "hf download zai-org/GLM-4.5-Air" in text
        example = yaml.safe_load(text)
        example["model"] = str(folder)
        if "auth" in example:  # the multi-host example's shared secret, here on this host
            secret = tmp_path / "cluster_secret"
            secret.write_text("s" * 43)
            secret.chmod(0o600)
            example["auth"] = {"secret_file": str(secret)}
        path.write_text(yaml.safe_dump(example))
        out = io.StringIO()
        assert check(path, out) == 0
        assert "46 layers, 96 query / 8 KV heads" in out.getvalue()


def test_missing_expert_weight_is_named(tmp_path: Path) -> None:
    from protocol.errors import ModelLoadError

    make_tiny_moe(tmp_path, "glm4_moe")
    config = _config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    del weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(ModelLoadError) as e:
        build_model(
            config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
        )
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in str(e.value)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(TINY_MOE))
def test_tiny_moe_on_cuda(arch: str, tmp_path: Path) -> None:
    """float32 on CUDA (the loop path) matches transformers; in bfloat16 the grouped GEMM
    (the CUDA default) agrees with the loop."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hf = make_tiny_moe(tmp_path, arch)
    config = _config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    model = build_model(
        config, dtype=torch.float32, device="cuda", backend=get_backend("torch"), weights=weights
    )
    prompt = list(range(7, 40))
    logits = PagedRunner(model).step({0: prompt})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(logits, ref)
    bf16 = build_model(
        config, dtype=torch.bfloat16, device="cuda", backend=get_backend("torch"), weights=weights
    )
    blocks = [layer.moe for layer in bf16.layers if layer.moe is not None]
    assert blocks and all(b.impl == "grouped" for b in blocks)
    h = torch.randn(300, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    grouped = blocks[0](h)
    blocks[0].impl = "loop"
    torch.testing.assert_close(grouped, blocks[0](h), rtol=2e-2, atol=2e-2)


def test_lazy_weights_read_what_load_weights_reads(tmp_path: Path) -> None:
    """Decode TP ranks read the checkpoint tensor by tensor (open_weights); same tensors."""
    from engine.weights.cache import open_weights

    make_tiny_moe(tmp_path, "glm4_moe")
    config = _config(tmp_path)
    eager = load_weights("hf", tmp_path, config)
    lazy = open_weights("hf", tmp_path, config)
    assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    for name, tensor in eager.items():
        assert torch.equal(lazy[name], tensor), name
    assert "model.layers.9.mlp.gate.weight" not in lazy
    with pytest.raises(KeyError):
        lazy["model.layers.9.mlp.gate.weight"]
    stage = open_weights("hf", tmp_path, config, want=lambda n: ".layers.1." in n)
    assert stage and all(".layers.1." in n for n in stage)


def test_memory_budgets_count_every_expert() -> None:
    """GPU budgets (protocol/device_budget.py) count the experts: GLM-4.5-Air's weights
    come to its published ~106B parameters, Qwen3-30B-A3B's to ~30.5B."""
    for cfg, low, high in ((GLM_45_AIR, 105e9, 108e9), (QWEN3_30B_A3B, 30e9, 31e9)):
        m = model_config_from_hf(cfg)
        attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
        total = m.num_layers * (attn + m.mlp_params_per_layer) + 2 * m.vocab_size * m.hidden_size
        assert low < total < high, total
    dense = model_config_from_hf({**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"]})
    assert dense.mlp_params_per_layer == 3 * 2048 * 6144

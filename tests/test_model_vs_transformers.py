"""The model path (engine.weights -> registry -> LlamaForCausalLM -> torch attention over a
paged cache) against Hugging Face transformers in float32: logits and greedy tokens.

Tiny random models cover every architecture and feature (GQA, llama3 and yarn RoPE scaling, qkv
bias, Qwen3 q/k norm, tied and untied embeddings); the SmolLM2 GGUF covers dequantization
and llama.cpp's q/k permutation on a real model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine.attention.base import AttentionMetadata, get_backend
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from engine.weights.cache import load_weights
from modelinfo.config import ModelConfig, model_config_from_hf
from modelinfo.gguf_config import model_config_from_gguf
from protocol.kv_layout import kv_kind_parts

BLOCK_SIZE = 16


class PagedRunner:
    """Drives a model like the engine does, for a fixed set of sequences: each sequence
    gets blocks from a shuffled free list (non-contiguous pages), and `step` runs one flat
    batch of new tokens for several sequences."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 96, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        parts = kv_kind_parts(cfg.kv_kind)  # K and V, or one MLA latent
        shape = (parts, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        dev, dtype = model.device, model.dtype
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=dev) for _ in range(model.num_local_layers)
        ]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Append `new_tokens[seq]` to each listed sequence (new ids start empty); return
        the logits [T, V] of every new token, in the order given."""
        dev = self.model.device
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for seq, toks in new_tokens.items():
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += toks
            pos += list(range(start, end))
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            self.lens[seq] = end
        tables = [self.tables[s] for s in new_tokens]
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
        )
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        return self.model.compute_logits(hidden).cpu()

    def greedy(
        self, prompts: list[list[int]], num_tokens: int
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Prefill all prompts in one step, then decode them together. Returns the tokens
        and the logits [num_prompts, num_tokens, V] each token was chosen from."""
        seqs = range(len(prompts))
        logits = self.step(dict(zip(seqs, prompts, strict=True)))
        steps = [logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1]]  # [B, V]
        for _ in range(num_tokens - 1):
            nxt = steps[-1].argmax(-1).tolist()
            steps.append(self.step({s: [t] for s, t in zip(seqs, nxt, strict=True)}))
        chosen = torch.stack(steps, dim=1)  # [B, num_tokens, V]
        return chosen.argmax(-1).tolist(), chosen


def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, no stopping at EOS. Recomputes the whole sequence
    each step: no cache API (it changed within transformers 5.x), and tiny models are cheap."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            out.append(int(hf_model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |diff| {err} vs max |ref| {ref.abs().max()}"


def engine_config(folder: Path) -> ModelConfig:
    """config.json -> ModelConfig through modelinfo. transformers 5 writes RoPE settings
    only under `rope_parameters`; model_config_from_hf reads the transformers-4 keys
    (`rope_theta`, `rope_scaling`), so mirror them until it reads both."""
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.get("rope_parameters") or {}
    raw.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raw.setdefault("rope_scaling", rope)
    return model_config_from_hf(raw)


TINY = {
    # GQA, llama3 RoPE scaling with a short original context so all three bands occur.
    "llama": dict(
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(rope_theta=1e6, sliding_window=None),
    # qkv bias, tied; YaRN (its attention factor on cos/sin) over a short original context
    "qwen2": dict(
        rope_theta=1e6,
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    ),
    "qwen3": dict(rope_theta=1e6, head_dim=32),  # q/k norm, head_dim != hidden / heads
}


def make_tiny(folder: Path, arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        arch,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # larger weights: clear argmax margins for the greedy check
        **{"tie_word_embeddings": False, **TINY[arch]},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_models_match_transformers(arch: str, tmp_path: Path) -> None:
    hf = make_tiny(tmp_path, arch)
    config = engine_config(tmp_path)
    assert config.architecture == hf.config.architectures[0]
    weights = load_weights("hf", tmp_path, config, tmp_path / "cache")
    model = build_model(
        config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
    )
    gen = random.Random(1)
    prompts = [[gen.randrange(512) for _ in range(n)] for n in (5, 17, 40)]

    # Every position's logits, all three prompts in one flat batch.
    logits = PagedRunner(model).step(dict(enumerate(prompts)))
    rows = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert_logits_close(logits[rows : rows + len(p)], ref)
        rows += len(p)

    # Greedy: one batched prefill, then batched decode through the paged cache.
    ours, _ = PagedRunner(model, seed=2).greedy(prompts, 24)
    for p, o in zip(prompts, ours, strict=True):
        assert o == hf_greedy(hf, p, 24)


def test_bfloat16_model_and_cache(tmp_path: Path) -> None:
    """bf16 weights, activations and KV (the fast CPU dtype with AVX512-BF16) stay close to
    float32 transformers; exactness is only claimed for float32."""
    hf = make_tiny(tmp_path, "qwen3")
    config = engine_config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    model = build_model(
        config, dtype=torch.bfloat16, device="cpu", backend=get_backend("torch"), weights=weights
    )
    runner = PagedRunner(model)  # KV in the model's dtype
    prompt = list(range(10, 50))
    logits = runner.step({0: prompt[:30]})
    logits = torch.cat([logits, runner.step({0: prompt[30:]})])  # behind a cached prefix
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert logits.dtype == torch.float32
    assert_logits_close(logits, ref, rel=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_on_cuda(arch: str, tmp_path: Path) -> None:
    """The same model path with weights, KV and attention on a CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hf = make_tiny(tmp_path, arch)
    config = engine_config(tmp_path)
    weights = load_weights("hf", tmp_path, config)
    model = build_model(
        config, dtype=torch.float32, device="cuda", backend=get_backend("torch"), weights=weights
    )
    prompts = [list(range(7, 30)), list(range(100, 105))]
    logits = PagedRunner(model).step({0: prompts[0][:16], 1: prompts[1]})
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0][:16]])).logits[0]
    assert_logits_close(logits[:16], ref)
    tokens, _ = PagedRunner(model, seed=3).greedy(prompts, 16)
    for p, o in zip(prompts, tokens, strict=True):
        assert o == hf_greedy(hf, p, 16)


def test_layer_ranges_compose(tmp_path: Path) -> None:
    """Two pipeline stages [0, 2) and [2, 3) give the single-stage model's logits."""
    make_tiny(tmp_path, "qwen2")
    config = engine_config(tmp_path)
    weights = load_weights("hf", tmp_path, config, tmp_path / "cache")
    backend = get_backend("torch")

    def build(start: int, end: int | None) -> LlamaForCausalLM:
        return build_model(
            config, dtype=torch.float32, device="cpu", backend=backend,
            layer_start=start, layer_end=end, weights=weights,
        )  # fmt: skip

    whole, first, last = build(0, None), build(0, 2), build(2, 3)
    assert first.lm_head is None and last.embed_tokens is None and last.lm_head is not None
    prompt = list(range(3, 30))
    want = PagedRunner(whole).step({0: prompt})
    a, b = PagedRunner(first), PagedRunner(last)
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    meta = AttentionMetadata(
        slot_mapping=pos.clone(), query_start_loc=[0, len(prompt)], seq_lens=[len(prompt)],
        block_tables=torch.tensor([[0, 1]]),
    )  # fmt: skip
    hidden = first(ids, pos, a.kv_caches, meta)
    meta.backend_state.clear()
    got = last.compute_logits(last(None, pos, b.kv_caches, meta, hidden_states=hidden))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


SMOL_PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [1604, 803, 24, 81, 28, 278, 727, 472, 1003],  # "def add(a, b):\n    return"
    [1, 4093, 198, 1780, 314, 216, 39, 1711, 216, 40, 47, 2, 198, 1, 520, 9531, 198],  # chat
    # "In 1969, the first humans landed on the Moon. ..." (43 tokens, 3 blocks)
    [
        *(788, 216, 33, 41, 38, 41, 28, 260, 808, 2973, 16176, 335, 260, 8872, 30, 378, 4527),
        *(436, 1217, 17600, 216, 33, 33, 284, 260, 17885, 592, 27639, 24955, 28, 42855, 20604),
        *(8873, 284, 7937, 18976, 30, 2550, 10900, 288, 2591, 28, 502),
    ],
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path, smollm2_hf, tmp_path_factory: pytest.TempPathFactory):
    config = model_config_from_gguf(smollm2_gguf)
    cache = tmp_path_factory.mktemp("weights")
    weights = load_weights("gguf", smollm2_gguf, config, cache)
    ours = build_model(
        config, dtype=torch.float32, device="cpu", backend=get_backend("torch"), weights=weights
    )
    return ours, smollm2_hf[1]


def test_smollm2_gguf_logits_match_transformers(smol) -> None:
    ours, hf = smol
    prompts = [*SMOL_PROMPTS, SMOL_PROMPTS[3] * 3]  # + a 129-token prompt (9 blocks)
    logits = PagedRunner(ours).step(dict(enumerate(prompts)))
    end = 0
    for p in prompts:
        end += len(p)
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        assert_logits_close(logits[end - 1], ref)


@pytest.mark.slow
def test_smollm2_gguf_greedy_32_tokens_match_transformers(smol) -> None:
    """Our batched greedy decode against transformers, teacher-forced: one HF forward over
    prompt + our continuation must pick each of our tokens at every position. By induction
    that is the same as HF's greedy loop producing our sequence (at 1/32 of the cost), and
    it also lets us compare every decode step's logits, not only the tokens.

    Slow (-m slow): the default run checks the same 32 greedy tokens of the same GGUF
    against transformers through the whole engine (test_engine_smollm2.py, which runs this
    model code) and the logits here at the prompts' ends (the test above); this one adds
    the logits of every decode step."""
    ours, hf = smol
    tokens, logits = PagedRunner(ours).greedy(SMOL_PROMPTS, 32)
    for p, toks, lg in zip(SMOL_PROMPTS, tokens, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1 :]  # [32, V]
        assert ref.argmax(-1).tolist() == toks
        assert_logits_close(lg, ref)

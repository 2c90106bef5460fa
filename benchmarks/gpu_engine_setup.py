"""The parts of benchmarks/gpu_engine.py that other GPU benchmarks share: the random
Llama-3-8B-shaped model (built in memory with transformers, no download) and kvserve's
copy of it, a ModelRunner over a paged cache, the scheduler stand-ins `execute` reads,
the same-run ceilings (device copy bandwidth, bf16 matmul rate), and the checks that
run before any timing (a tiny float32 Llama's greedy tokens, the 8B model's logits).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.attention.base import get_backend
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from engine.scheduler import ScheduledRequest
from modelinfo.config import model_config_from_hf
from protocol.kv_layout import KVLayout

BLOCK = 16
"""KV cache block size (tokens); --block-size sets it."""
SPEC_TFLOPS = 989.0
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


# -- a scheduler stand-in: fixed block tables, what ModelRunner.execute reads -----------
@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeKV:
    tables: dict[str, list[int]] = field(default_factory=dict)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def decode_rows(
    batch: int, ctx: int, blocks: torch.Tensor, per_seq: int
) -> tuple[FakeKV, list[FakeRequest]]:
    """`batch` requests d0, d1, ... with `ctx` tokens cached and one to decode, request i
    holding blocks[i * per_seq : (i + 1) * per_seq]."""
    kv = FakeKV()
    reqs = []
    for i in range(batch):
        kv.tables[f"d{i}"] = blocks[i * per_seq : (i + 1) * per_seq].tolist()
        reqs.append(FakeRequest(f"d{i}", [7] * (ctx + 1), ctx))
    return kv, reqs


def step_of(reqs: list[FakeRequest], num_new: list[int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(cast(Any, r), n) for r, n in zip(reqs, num_new, strict=True)]


def sync_time(fn: Any, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def ceilings() -> tuple[float, float]:
    """(copy GB/s read + write, bf16 matmul TFLOP/s), medians of 10 timed runs."""
    src = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB x 2
    dst = torch.empty_like(src)
    t = sync_time(lambda: dst.copy_(src), 10)
    bw = 2 * src.numel() * 2 / t / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = sync_time(lambda: a @ b, 10)
    return bw, 2 * 8192**3 / t / 1e12


def hf_model(cfg: dict[str, Any], dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> Any:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = HFLlama(LlamaConfig(**cfg, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def ours(
    hf: Any, cfg: dict[str, Any], dtype: torch.dtype, backend: str, device: str = "cuda"
) -> LlamaForCausalLM:
    mc = model_config_from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
    return build_model(
        mc,
        dtype=dtype,
        device=device,
        backend=get_backend(backend),
        weights=dict(hf.state_dict()),
    )


def make_runner(
    model: LlamaForCausalLM,
    num_blocks: int,
    dtype: torch.dtype,
    graphs: bool,
    max_batch: int,
    sizes: list[int] | None = None,
    compile_layers: bool = True,
    device: str = "cuda",
) -> ModelRunner:
    c = model.config
    layout = KVLayout(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        block_size=BLOCK,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
    )
    backend = model.layers[0].backend  # type: ignore[union-attr]
    return ModelRunner(
        model,
        layout,
        num_blocks,
        device=torch.device(device),
        dtype=dtype,
        backend=backend,
        cuda_graphs=graphs,
        max_batch=max_batch,
        graph_sizes=sizes,
        compile_layers=compile_layers,
    )


def set_backend(model: LlamaForCausalLM, name: str) -> None:
    backend = get_backend(name)
    for layer in model.layers:
        layer.backend = backend  # type: ignore[union-attr]


def greedy(
    runner: ModelRunner, prompts: list[list[int]], steps: int, tag: str = "r"
) -> list[list[int]]:
    """Prefill every prompt in one mixed step, then `steps` decode steps of all (request
    ids `tag`0, `tag`1, ...: a new tag for each call on one runner)."""
    kv = FakeKV()
    reqs = []
    nxt = 0
    for i, p in enumerate(prompts):
        n = -(-(len(p) + steps) // BLOCK)
        kv.tables[f"{tag}{i}"] = list(range(nxt, nxt + n))[::-1]  # out of order
        nxt += n
        reqs.append(FakeRequest(f"{tag}{i}", list(p), 0))
    new = [len(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = runner.execute(step_of(reqs, new), cast(Any, kv))
        assert logits is not None
        toks = logits.argmax(-1).tolist()
        for r, n, t, o in zip(reqs, new, toks, outs, strict=True):
            r.num_computed_tokens += n
            r.all_token_ids.append(t)
            o.append(t)
        new = [1] * len(reqs)
    return outs


def check_tiny(report: dict[str, Any]) -> None:
    hf = hf_model(TINY, torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (5, 40, 130, 300)]
    # 4 prompts in one batch, then the third alone: 5 token lists per variant
    results = {}
    for name, backend, graphs, fuse in (
        ("torch", "torch", False, False),
        ("flex+graphs+compiled layers", "flex", True, True),
        ("flex+graphs", "flex", True, False),
        ("flex eager", "flex", False, False),
    ):
        model = ours(hf, TINY, torch.float32, backend)
        runner = make_runner(model, 256, torch.float32, graphs, 8, compile_layers=fuse)
        # the 4 prompts in one batch, then the third alone (decode at batch 1: one-row
        # steps, engine/models/gemv.py's kernels under compiled layers)
        results[name] = greedy(runner, prompts, 24) + greedy(runner, prompts[2:3], 24, tag="b1-")
    ref = []
    for p in [*prompts, prompts[2]]:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        ref.append(out[0, len(p) :].tolist())
    results["transformers"] = ref
    same = {k: v == results["torch"] for k, v in results.items()}
    report["tiny_fp32_greedy_identical"] = same
    print("tiny float32 greedy tokens identical to the torch backend:", same, flush=True)
    assert all(same.values()), results


def check_big(model: LlamaForCausalLM, hf: Any, report: dict[str, Any]) -> None:
    """flex vs the torch reference backend on the 8B model, same inputs (three prompts,
    then 8 teacher-forced decode steps), separate small caches. In bf16 the two differ by
    rounding, so each is also compared with transformers (an independent bf16 stack): flex
    must be as close to it as the reference is."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in (1000, 37, 300)]
    steps = 9
    forced = [[1000 + 7 * (s + 1) + i for s in range(steps)] for i in range(3)]
    logits = {}
    for name in ("torch", "flex"):
        set_backend(model, name)
        runner = make_runner(model, 256, torch.bfloat16, False, 4)
        kv = FakeKV({f"r{i}": list(range(80 * i, 80 * i + 80))[::-1] for i in range(3)})
        reqs = [FakeRequest(f"r{i}", list(p), 0) for i, p in enumerate(prompts)]
        new = [len(p) for p in prompts]
        rows = []
        for s in range(steps):
            out = runner.execute(step_of(reqs, new), cast(Any, kv))
            assert out is not None
            rows.append(out.float())
            for i, (r, n) in enumerate(zip(reqs, new, strict=True)):
                r.num_computed_tokens += n
                r.all_token_ids.append(forced[i][s])
            new = [1] * 3
        logits[name] = torch.cat(rows)  # row s * 3 + i
        del runner
    hf_rows = torch.empty_like(logits["torch"])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + forced[i][: steps - 1]], device="cuda")
            out = hf(ids).logits[0, len(p) - 1 :].float()  # [steps, V]
            hf_rows[i::3] = out
    logits["transformers"] = hf_rows

    def rel(a: str, b: str) -> float:
        return ((logits[a] - logits[b]).norm() / logits[b].norm()).item()

    def agree(a: str, b: str) -> float:
        return (logits[a].argmax(-1) == logits[b].argmax(-1)).float().mean().item()

    res = {
        "flex_vs_torch": (rel("flex", "torch"), agree("flex", "torch")),
        "flex_vs_transformers": (rel("flex", "transformers"), agree("flex", "transformers")),
        "torch_vs_transformers": (rel("torch", "transformers"), agree("torch", "transformers")),
        "rows": logits["torch"].shape[0],
    }
    report["bf16_8b_logits_rel_err_argmax_agree"] = res
    print(f"8B bf16 logits (rel err, argmax agreement): {res}", flush=True)
    f_rel, f_agree = res["flex_vs_transformers"]
    t_rel, t_agree = res["torch_vs_transformers"]
    assert f_rel <= 1.5 * t_rel + 1e-3 and f_agree >= t_agree - 0.1, res
    set_backend(model, "flex")


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads: every matrix but the embedding (one row per token)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or name.startswith("embed_tokens"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total

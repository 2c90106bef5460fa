"""How far bf16 alone moves a random DeepSeek-V2-Lite-shaped model: transformers in bf16
against transformers in float32, and the engine in bf16 against both, on the same random
weights and one 512-token prompt. benchmarks/gpu_mla.py compares the engine with
transformers in bf16 only; this gives that figure its noise floor.

    python benchmarks/gpu_mla_noise.py cuda      # ~63 GB of device memory at its peak
"""

import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchmarks.gpu_mla as g

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
cfg = dict(g.DEEPSEEK_V2_LITE)
N = 512
ids = torch.randint(3, cfg["vocab_size"], (N,), generator=torch.Generator().manual_seed(2)).to(dev)


def hf_logits(hf: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def cmp(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    rel = ((a - b).norm() / b.norm()).item()
    ag = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"{name}: rel err {rel:.3e}, argmax agree {ag * 100:.1f}%", flush=True)


h32 = g.hf_model(cfg, torch.float32, dev)
H32 = hf_logits(h32)
del h32
gc.collect()
if dev.type == "cuda":
    torch.cuda.empty_cache()
h16 = g.hf_model(cfg, torch.bfloat16, dev)
H16 = hf_logits(h16)
model = g.ours(h16, cfg, torch.bfloat16, dev)
runner = g.make_runner(model, 64, dev)
with torch.no_grad():
    O16 = model.compute_logits(
        model(ids, torch.arange(N, device=dev), runner.kv_caches, g._meta(N, dev))
    ).float()
cmp(H16, H32, "transformers bf16 vs transformers fp32")
cmp(O16, H32, "engine bf16 vs transformers fp32")
cmp(O16, H16, "engine bf16 vs transformers bf16")

"""SparseMoeBlock: the mixture-of-experts MLP of one layer (Qwen3-MoE, Glm4Moe).

    h [T, H] (post-attention-normed)
    logits = h @ W_router^T                       [T, E] (float32 for Glm4Moe)
    w, ids = route(logits)                        engine/models/moe_router.py
    y = experts(h, ids, w)                        engine/models/moe_experts.py
      + shared_expert(h)                          SwiGLU seen by every token (Glm4Moe)

Under decode TP (engine/parallel/tp_model.py) each rank holds the slice [i0, i1) of every
routed expert's intermediate dim and of the shared expert's, exactly like the dense MLP is
split: the router is replicated, every rank routes identically, and its output is a
partial sum the caller all-reduces. No token moves between ranks and the result is the
single-rank sum (up to the order of the float additions).

Checkpoint names are Hugging Face's, under `model.layers.{i}.mlp.`: `gate.weight`,
`gate.e_score_correction_bias`, `experts.{e}.{gate,up,down}_proj.weight`,
`shared_experts.{gate,up,down}_proj.weight`; the experts are stacked at load.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.moe_experts import default_impl, run_experts
from engine.models.moe_router import route
from engine.models.params import assign, meta_param
from modelinfo.config import ModelConfig
from protocol.parallel import split_range


class SparseMoeBlock(nn.Module):
    """Owns one layer's router, routed experts (stacked) and shared expert, or the slice
    [i0, i1) of their intermediate dims for TP rank `tp_rank` of `tp_size`."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = moe = cfg.moe
        h, e = cfg.hidden_size, moe.num_experts
        self.inter = split_range(moe.intermediate_size, tp_size, tp_rank)
        self.shared = split_range(moe.shared_intermediate_size, tp_size, tp_rank)
        i, s = self.inter[1] - self.inter[0], self.shared[1] - self.shared[0]
        self.gate_weight = meta_param((e, h), torch.float32 if moe.router_float32 else dtype)
        self.score_bias = meta_param((e,), torch.float32) if moe.scoring == "sigmoid" else None
        self.w13 = meta_param((e, 2 * i, h), dtype)
        self.w2 = meta_param((e, h, i), dtype)
        has_shared = moe.shared_intermediate_size > 0
        self.shared_gate_up = meta_param((2 * s, h), dtype) if has_shared else None
        self.shared_down = meta_param((h, s), dtype) if has_shared else None
        self.impl = default_impl(device, dtype)
        """"grouped" or "loop" (engine/models/moe_experts.py); both exact, settable."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] normed -> the MLP output [T, H] (this rank's partial sum under TP)."""
        logits = F.linear(h.to(self.gate_weight.dtype), self.gate_weight)  # [T, E]
        weights, ids = route(logits, self.moe, self.score_bias)
        out = run_experts(self.impl, h, ids, weights, self.w13, self.w2)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None
            gate, up = F.linear(h, self.shared_gate_up).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.shared_down)
        return out

    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        device: torch.device,
        missing: list[str],
    ) -> None:
        """Take this block's tensors (HF names under `prefix`, e.g. "model.layers.3.mlp."),
        slicing the intermediate dims and stacking the experts; absent names go to `missing`."""
        (i0, i1), (s0, s1) = self.inter, self.shared

        def get(name: str) -> torch.Tensor | None:
            if prefix + name not in weights:
                missing.append(prefix + name)
                return None
            return weights[prefix + name]

        def swiglu(stem: str, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            gate, up, down = (get(f"{stem}{p}_proj.weight") for p in ("gate", "up", "down"))
            if gate is None or up is None or down is None:
                return None
            return torch.cat([gate[a:b], up[a:b]]), down[:, a:b]

        router = get("gate.weight")
        if router is not None:
            assign(self, "gate_weight", router, device, prefix + "gate.weight")
        if self.score_bias is not None:
            bias = get("gate.e_score_correction_bias")
            if bias is not None:
                assign(self, "score_bias", bias, device, prefix + "gate.e_score_correction_bias")
        experts = [swiglu(f"experts.{e}.", i0, i1) for e in range(self.moe.num_experts)]
        if all(x is not None for x in experts):
            dtype = self.w13.dtype  # stack in the model dtype: bf16 experts stay bf16
            w13 = torch.stack([x[0].to(dtype) for x in experts if x is not None])
            w2 = torch.stack([x[1].to(dtype) for x in experts if x is not None])
            assign(self, "w13", w13, device, prefix + "experts.*.{gate,up}_proj.weight")
            assign(self, "w2", w2, device, prefix + "experts.*.down_proj.weight")
        if self.shared_gate_up is not None:
            shared = swiglu("shared_experts.", s0, s1)
            if shared is not None:
                assign(self, "shared_gate_up", shared[0], device, prefix + "shared_experts")
                assign(self, "shared_down", shared[1], device, prefix + "shared_experts")

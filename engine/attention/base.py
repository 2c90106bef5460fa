"""The attention backend interface and the per-step metadata every backend reads.

One engine step runs a flat batch of T new tokens from B sequences. Sequence b owns query
rows query_start_loc[b] : query_start_loc[b+1]; its KV after this step has seq_lens[b]
tokens, the last (q_len) of which are the new ones:

    tokens of seq b:  [ cached ......................... | new (q_len) ]
                       0                     seq_len-q_len            seq_len
    new token j of seq b sits at position seq_len - q_len + j and may attend to
    positions 0 ..= its own position (causal).

KV of every layer lives in a paged cache tensor [2, num_blocks, block_size, Hkv, D]
(see protocol/kv_layout.py); block_tables[b, i] is the block holding tokens
i*block_size .. (i+1)*block_size-1 of seq b, and slot_mapping[t] is the flat slot
(block_id * block_size + offset) where new token t's K/V must be written. A uint8 cache
holds fp8_e4m3 rows, D values and their float32 scale each (last dim D + 4): backends
write rows quantized and attend over the values read back dequantized
(engine/attention/kv_quant.py), the new tokens' own included.

Multi-head latent attention (MLA, DeepSeek) keeps one entry per token instead, in a cache
[1, num_blocks, block_size, 1, C]: `forward_mla` attends with every query head over the
entries as keys (all C dims) and their leading `value_dim` dims as values (MQA over the
latent; the model absorbed its per-head key/value projections into q and the output).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of the flat batch; built once by the model runner, read by
    every layer. Backends may cache derived tensors in `backend_state` (scoped to the step)."""

    slot_mapping: torch.Tensor
    """[T] int64: flat KV slot for each new token."""
    query_start_loc: list[int]
    """B+1 cumulative query lengths (host list)."""
    seq_lens: list[int]
    """B total KV lengths after this step (host list)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32 or int64 on the device, padded with 0 (or any block id)."""
    backend_state: dict[str, Any] = field(default_factory=dict)
    seq_lens_tensor: torch.Tensor | None = None
    """[B] int32 on the device, equal to seq_lens, when the model runner keeps one (a
    static buffer under CUDA graphs): backends that build masks on the device read it
    instead of uploading seq_lens."""
    rope_in_write: bool = True
    """False: no backend rotates q and k on write this step (AttentionBackend.
    rotates_on_write): the decode graphs' warm-up runs each bucket that way too, so that
    the glue's variant with RoPE, which prefill and mixed steps run, is compiled before
    serving (engine/cuda_graphs.py)."""
    dcp_size: int = 1
    dcp_rank: int = 0
    """Decode context parallel (DESIGN §6): this rank's cache holds only the tokens
    t ≡ dcp_rank (mod dcp_size) of each sequence, at local position t // dcp_size;
    block_tables and slot_mapping address those local positions, and slot_mapping is -1
    for new tokens another rank holds. seq_lens and query positions stay global. Only
    LSEAttentionBackends read a striped cache; with 1 every token is here."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]


class AttentionBackend(ABC):
    """Computes causal attention of the new tokens over paged KV.

    Contract of `forward`: first writes the new tokens' k and v into `kv_cache` at
    `meta.slot_mapping` (the only mutation), then returns, for every new token, softmax(q k^T
    * scale) v over that sequence's positions <= its own. GQA: query head h reads KV head
    h // (Hq // Hkv). Must be exact to float rounding against the torch reference backend
    (tests/test_attention_backends.py is the conformance suite).
    """

    name: str = ""
    graph_safe_decode: bool = False
    """True when a pure-decode step reads only meta's tensors (block_tables,
    seq_lens_tensor, slot_mapping) on the device, never host values of seq_lens, and makes
    no host sync: such a step can be captured once in a CUDA graph and replayed on new
    values of those tensors (engine/cuda_graphs.py)."""

    supports_mla: bool = False
    """True when `forward_mla` is implemented (MLA models need it)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def rotates_on_write(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """True when this step's `forward_rotating` applies RoPE to q and k itself, in the
        kernel that writes the cache (one launch where the layer's RoPE and the write
        were two): the layer then hands it q and k unrotated. False by default."""
        return False

    def forward_rotating(
        self,
        q: torch.Tensor,  # [T, Hq, D], not rotated yet
        k: torch.Tensor,  # [T, Hkv, D], not rotated yet
        v: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """`forward` of q and k rotated by cos / sin (engine/rope.py apply_rotary)."""
        from engine.rope import apply_rotary

        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.forward(q, k, v, kv_cache, meta, scale)

    def forward_mla(
        self,
        q: torch.Tensor,  # [T, Hq, C] latent-space queries
        latent: torch.Tensor,  # [T, 1, C] the new tokens' cache entries
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, C]
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:  # [T, Hq, value_dim]
        """Contract: writes `latent` at meta.slot_mapping (the only mutation), then returns
        softmax(q e^T * scale) e[:value_dim] over each sequence's entries e at positions
        <= the token's (the contract of `forward` with K = e, V = e[:value_dim], one KV
        head)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not run MLA models")


class LSEAttentionBackend(AttentionBackend):
    """An attention backend that also returns each output row's log-sum-exp, so results
    over disjoint parts of the keys merge exactly (merge_partials): decode context
    parallelism runs it on each rank's token stripe (meta.dcp_size > 1).

    Contract of `forward_with_lse`: writes the new tokens this rank holds (slot_mapping
    >= 0) into `kv_cache` (the only mutation); for every new token and query head returns
    softmax-weighted values over the keys in this cache whose GLOBAL position is <= the
    token's, and lse = log(sum(exp(q k^T * scale))) over those keys (natural log, float32).
    A row with no such key has out 0 and lse -inf. With dcp_size 1, out equals the
    reference backend's (conformance suite: tests/test_attention_backends.py).
    """

    @abstractmethod
    def forward_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] (this rank's)
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hq] float32
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self.forward_with_lse(q, k, v, kv_cache, meta, scale)[0]

    def forward_mla_with_lse(
        self,
        q: torch.Tensor,  # [T, Hq, C]
        latent: torch.Tensor,  # [T, 1, C]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, C] (this rank's stripe)
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, value_dim], [T, Hq] float32
        """`forward_mla` over this rank's (striped) entries, with the LSE (the contract of
        `forward_with_lse`)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not run MLA models")

    def forward_mla(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:
        return self.forward_mla_with_lse(q, latent, kv_cache, meta, scale, value_dim)[0]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact attention from P partial results over disjoint key sets:
    outs [P, T, H, D] (each normalized over its keys), lses [P, T, H] -> [T, H, D].

        out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m),  m = max_p lse_p

    Every row needs a key in some part (a token always sees itself)."""
    m = lses.max(dim=0).values  # [T, H]
    w = torch.exp(lses - m)  # [P, T, H]; a part without keys weighs exp(-inf) = 0
    num = (w.unsqueeze(-1) * outs.float()).sum(dim=0)
    return (num / w.sum(dim=0).unsqueeze(-1)).to(outs.dtype)


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend; an unknown name lists the known ones."""
    # Import for registration side effects of the built-in backends.
    from engine.attention import cpu_paged, flex, torch_lse, torch_ref  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()

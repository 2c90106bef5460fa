"""Prefill order: which of a step's requests get the token budget first.

    fcfs      running requests in admission order, each taking what the budget leaves,
              then waiting requests front first while budget is left. A turn that brings
              a few hundred new tokens waits behind every whole prefill admitted before
              it (a multi-second first turn, an evicted history recomputed).
    shortest  decodes first (in admission order), then running prefills and waiting
              requests in one order: the fewest tokens left to compute first. A waiting
              request's count is estimated before admission from its GPU prefix and the
              KV connector's answer (benchmarks/pool_sim_queue.py, `srpf`); it is
              admitted when its turn comes with budget left, so admission still matches
              the prefix right before the first chunk (a sibling's shared prefix computed
              meanwhile is found). The bound: a request `bound_steps` steps after its
              arrival goes before every request under the bound, oldest first, so a long
              prompt is never passed over for good.

What shortest trades: the longest prompts wait longer (on the agentic trace's model,
p99 TTFT 63 s against 39 s with fcfs) so that short turns do not queue behind them (p50
1.4 s / p90 3.6 s against 3.0 s / 10.0 s); docs/configuration.md `cache.prefill_order`.
"""

from __future__ import annotations

import msgspec

PREFILL_ORDERS = ("fcfs", "shortest")


class PrefillOrder(msgspec.Struct, frozen=True, kw_only=True):
    """How the scheduler orders a step's prefills (engine/scheduler.py)."""

    kind: str = "shortest"
    """"shortest" or "fcfs"."""
    bound_steps: int = 64
    """shortest: steps after its arrival from which a request goes first (oldest first)."""

    def __post_init__(self) -> None:
        if self.kind not in PREFILL_ORDERS:
            raise ValueError(f"prefill order must be one of {PREFILL_ORDERS}, got {self.kind!r}")
        if self.bound_steps < 1:
            raise ValueError(f"prefill bound_steps must be >= 1, got {self.bound_steps}")

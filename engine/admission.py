"""Admission rule: whether a waiting request may join the running batch now.

    chunk         admitted when the blocks of the chunk scheduled now are free (allocation
                  decides). A running prefill that later finds blocks short preempts the
                  most recently admitted request, whose work is computed again.
    whole_prompt  admitted only when the free blocks (cached free blocks count: they are
                  evictable) cover what every running or loading request still lacks to
                  hold its tokens, plus this request's whole prompt after its prefix hit
                  (KV the connector loads lands in blocks too, so it counts):

                      free >= sum(short(r, r.num_tokens) for r in running + loading)
                              + short(new, new.num_tokens, its prefix hit)

                  What is admitted then never runs out of blocks before its prompt is in
                  (a request that samples only its first token, a prefill instance's, is
                  never preempted). Blocks a connector still holds (a finished prompt's KV
                  on its way to decode) are not free: the rule waits for their release
                  rather than start a prompt that would run out before they come back. A
                  prompt larger than the whole cache (which the engine refuses) is started
                  alone when nothing else runs or loads, as chunk would.

What whole_prompt costs: while free blocks are short and held ones are about to come back,
chunk would already fill the step's budget with the next prompt's first chunks; whole_prompt
leaves it unused until they are released (tests/test_scheduler_admission.py measures both).

Why whole_prompt is the prefill role's rule (cluster.yaml `cache.prefill_admission`): a
burst of prompts larger than the cache is a prefill instance's cold start, and chunk
admits them all, starts them and pushes some back (run 8: 23 preemptions); at that
shape whole_prompt takes the same steps without one (docs/benchmarks.md "Prefill
admission"). Decode and unified engines keep chunk:
their rows grow by the tokens they generate, so no reservation at admission rules
preemption out, and reserving whole prompts there only admits less.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: engine/config.py validates names without torch
    from engine.kv_cache_manager import KVCacheManager, PrefixHit
    from engine.request import Request

ADMISSIONS = ("chunk", "whole_prompt")


class Admission(ABC):
    """Decides, before any block is allocated, whether a waiting request may be admitted
    (engine/scheduler.py asks it after the prefix match and the connector's answer). Pure:
    mutates nothing; a refusal is the scheduler's "blocks are short" (the request stays
    waiting, nothing more is admitted this step)."""

    name: str

    @abstractmethod
    def admits(
        self,
        kv: KVCacheManager,
        request: Request,
        prefix: PrefixHit,
        admitted: Iterable[Request],
    ) -> bool:
        """May `request` (its GPU prefix hit `prefix`) join `admitted` (the running and
        loading requests) now?"""


class ChunkAdmission(Admission):
    """Admits every request; allocating the chunk scheduled now decides."""

    name = "chunk"

    def admits(
        self,
        kv: KVCacheManager,
        request: Request,
        prefix: PrefixHit,
        admitted: Iterable[Request],
    ) -> bool:
        return True


class WholePromptAdmission(Admission):
    """Admits a request only if every admitted request's rest and its whole prompt fit the
    free blocks (module doc)."""

    name = "whole_prompt"

    def admits(
        self,
        kv: KVCacheManager,
        request: Request,
        prefix: PrefixHit,
        admitted: Iterable[Request],
    ) -> bool:
        num_reserved = 0
        alone = True
        for r in admitted:
            alone = False
            num_reserved += kv.num_blocks_short(r, r.num_tokens)
        need = kv.num_blocks_short(request, request.num_tokens, prefix)
        if num_reserved + need <= kv.pool.num_free_blocks:
            return True
        # Never fits, even with every block free: started alone, as chunk would.
        return alone and need > kv.pool.num_blocks


def make_admission(name: str) -> Admission:
    """The rule called `name` (one of ADMISSIONS)."""
    if name == "chunk":
        return ChunkAdmission()
    if name == "whole_prompt":
        return WholePromptAdmission()
    raise ValueError(f"admission must be one of {ADMISSIONS}, got {name!r}")

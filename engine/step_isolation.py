"""A step that fails fails only the requests that make it fail (the blast radius of one).

    sampling  the batched sampler raises ─▶ every row sampled alone: rows that raise
              again are the culprits, the others keep their tokens (a row's token never
              depends on the other rows: greedy is its argmax, a seeded draw is re-seeded
              from (seed, position), penalties and grammar masks are per row)
    forward   the batched forward raises ─▶ bisection: each half runs on its own (KV
              writes of a step are idempotent: the same tokens into the same slots), a
              half that raises is split again; a single request that raises alone is a
              culprit; the rest runs once more as one batch for its logits. On a TP x
              DCP instance the ranks agree the step failed, whether every rank raised
              or one alone (engine/parallel/rank_isolation.py), and stay in step
              (ForwardFailed); the driver broadcasts each bisection run (RankStep.probe)
              and the final one, so collectives stay matched; the connector's loads ran
              once, its saves and reports only with the final run. A pipeline stage
              bisects on its own and tells the stages after it through the step
              (engine/parallel/pp_isolation.py)
    append    detokenization and stop checks of one request raise ─▶ that request fails

The engine then fails the culprits with the error (RequestOutput.error; their KV is
freed and never cached or saved) and serves the others exactly as if the culprits had
never been in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from engine.faults import EngineFaults
from engine.sampler import Sampler, SamplerOutput, SamplingState

T = TypeVar("T")

FAILED_TOKEN = -1
"""The token a failed row carries in a SamplerOutput (never appended)."""


class ForwardFailed(RuntimeError):
    """The forward of a step failed on a rank of a TP x DCP instance (on every rank
    alike, as the step's input makes them fail, or on some alone), and the ranks agreed
    it failed: they are in step and wait for the driver's next message, which re-runs
    parts of the step to find the culprits, every rank together."""


def describe(e: BaseException) -> str:
    if isinstance(e, ForwardFailed):
        return str(e)  # already "<type>: <message>" of the ranks' own error
    return f"{type(e).__name__}: {e}"


def sample_isolating(
    sampler: Sampler,
    logits: torch.Tensor,
    states: Sequence[SamplingState],
    faults: EngineFaults | None = None,
    before_wait: Callable[[torch.Tensor], None] | None = None,
) -> tuple[SamplerOutput, dict[int, str]]:
    """Sample every row; (output, {row: error} of the rows that could not be sampled).
    A failed row's token is FAILED_TOKEN. `before_wait`: Sampler.sample's, for the whole
    batch only (not called when a row fails)."""

    def sample(
        rows: torch.Tensor,
        row_states: Sequence[SamplingState],
        hook: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        if faults is not None:
            faults.check("sample", (s.params for s in row_states))
        return sampler.sample(rows, row_states, hook)

    try:
        return sample(logits, states, before_wait), {}
    except Exception as batch_error:
        if len(states) == 1:
            return SamplerOutput([FAILED_TOKEN], [None], [None]), {0: describe(batch_error)}
    out = SamplerOutput([], [], [])
    failed: dict[int, str] = {}
    for i, state in enumerate(states):
        try:
            one = sample(logits[i : i + 1], [state])
        except Exception as e:
            failed[i] = describe(e)
            one = SamplerOutput([FAILED_TOKEN], [None], [None])
        out.token_ids += one.token_ids
        out.logprobs += one.logprobs
        out.top_logprobs += one.top_logprobs or [None]
    return out, failed


def find_culprits(
    items: Sequence[T], run: Callable[[Sequence[T]], object], error: BaseException
) -> dict[int, str]:
    """{index: error} of the items that make `run` raise on their own, given that
    `run(items)` raised `error`: every failing subset is halved and its halves run
    again (about 2·k·log2(n) calls for k culprits). `run` must be safe to repeat (a
    forward rewrites the same KV slots with the same values)."""
    failed: dict[int, str] = {}

    def search(idx: list[int], known: BaseException | None) -> None:
        if known is None:
            try:
                run([items[i] for i in idx])
                return
            except Exception as e:
                known = e
        if len(idx) == 1:
            failed[idx[0]] = describe(known)
            return
        half = len(idx) // 2
        search(idx[:half], None)
        search(idx[half:], None)

    search(list(range(len(items))), error)
    return failed

"""A TP x DCP forward that fails on some ranks only fails the step on every rank alike.

    rank r's forward raises (its device, its memory, an injected fault) after k of the
    step's collectives     ─▶ r takes part in the remaining ones with zeros
                              (TPLlamaModel.collectives: the same list on every rank),
                              so no other rank waits in a collective forever
    every rank, after its forward, success or not
                           ─▶ all-gather of "did my forward fail" (cpu group): every
                              rank now knows the step failed, and rank 0 gets the first
                              failing rank's error
    the step failed        ─▶ every rank skips its saves and report, exactly as when
                              every rank fails alike; the driver bisects the step with
                              probe runs every rank takes part in
                              (engine/step_isolation.py): a request that makes one rank
                              fail is found and fails alone; a rank that fails whatever
                              the batch fails every request of the step, cleanly, and
                              the instance goes on to the next step

The other ranks' outputs of a failed step are wrong (they summed a zero partial), which
is why no rank saves or reports it: only the probes' and the final run's KV writes
count, and they rewrite the same slots. Not covered: a collective that itself raises (a
peer process died): the instance goes down as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.parallel.comm import ParallelContext, all_gather, all_reduce_, recv_bytes, send_bytes
from engine.parallel.tp_model import Collective
from engine.step_isolation import describe


def forward_agreeing(
    ctx: ParallelContext,
    forward: Callable[[], torch.Tensor],
    collectives: Callable[[], Sequence[Collective]],
) -> tuple[torch.Tensor | None, str | None]:
    """Run this rank's forward; (hidden, None) when it succeeded on EVERY rank, else
    (None, why): on rank 0 the first failing rank's error. Every rank calls it for the
    same step. `collectives()`: the step's collectives in order (only called on failure)."""
    start = ctx.num_collectives
    error: str | None = None
    hidden = None
    try:
        hidden = forward()
    except Exception as e:
        error = describe(e)
        complete_collectives(ctx, collectives()[ctx.num_collectives - start :])
    error = agree(ctx, error)
    return (hidden, None) if error is None else (None, error)


def complete_collectives(ctx: ParallelContext, rest: Sequence[Collective]) -> None:
    """Take part in the forward's remaining collectives with zeros."""
    for c in rest:
        zeros = torch.zeros(c.shape, dtype=c.dtype, device=ctx.device)
        if c.kind == "reduce":
            all_reduce_(zeros)
        else:
            assert ctx.dcp_group is not None, "a gather is a DCP group's"
            all_gather(zeros, ctx.dcp_group, ctx.dcp_size)
        ctx.num_collectives += 1


def agree(ctx: ParallelContext, error: str | None) -> str | None:
    """Every rank's view of whether the step's forward failed anywhere (None: nowhere);
    rank 0 gets the first failing rank's error, the others a summary."""
    mine = torch.tensor([1 if error is not None else 0], dtype=torch.int64)
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(flags, mine, group=ctx.cpu_group)
    failed = [r for r, f in enumerate(flags) if int(f.item())]
    if not failed:
        return None
    first = failed[0]
    if first != 0:
        if ctx.rank == first:
            assert error is not None
            send_bytes(error.encode(), 0, ctx.cpu_group)
        elif ctx.rank == 0:
            theirs = recv_bytes(first, ctx.cpu_group).decode()
            return f"{theirs} (on decode rank {first} of {ctx.world_size})"
    return error or f"the forward failed on rank {first}"

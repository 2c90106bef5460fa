"""A pipeline stage whose forward fails finds the culprits itself (the blast radius of one).

    stage s receives step k (sequences 0..n-1, culprits found upstream)
        skip       the upstream culprits and the requests this stage already knows failed
                   (their later chunks may be on the ring: the driver issued them before
                   it collected the step that failed)
        forward    its layers over the rest; if that raises: bisection over the rest on
                   this stage alone (find_culprits: each half re-run, KV writes of a step
                   are idempotent), then the rest once more for its hidden states
        saves      the connector's meta without the culprits' saves and sends
                   (KVConnectorWorker.without_requests), so nothing of a culprit's
                   invalid KV leaves the stage
        pass on    step k with culprits = upstream ∪ found here: stages after s skip them
                   alike; the last stage returns them in StageResult.culprits

The stages agree without a round trip: each culprit is found by exactly one stage, and
every stage after it learns it from the step itself, in ring order. Stages before s
computed the culprit's layers correctly (their saves of it are valid KV of their layers;
the driver stops expecting the pool saves of every stage). The driver then fails each
culprit (engine/parallel/pp_engine.py), forgets the prefix-cache entries of the blocks
the failed step computed for it, and serves the others with exact tokens: a skipped
sequence's rows in the hidden states are zeros, no other row depends on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.faults import EngineFaults, InjectedFault
from engine.parallel.step_inputs import batch_tensors
from engine.step_isolation import find_culprits
from protocol.rank_messages import StepBatch

StageForward = Callable[[Sequence[int], StepBatch, torch.Tensor | None], torch.Tensor]
"""(which of the step's sequences, their batch, their input hidden states or None on
the first stage) -> their output hidden states [rows, H]."""


def subset_batch(batch: StepBatch, seqs: Sequence[int]) -> tuple[StepBatch, list[int]]:
    """The batch of sequences `seqs` only, and the rows of the full batch they hold."""
    ids: list[int] = []
    positions: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    for b in seqs:
        q0, q1 = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        if batch.input_ids:
            ids.extend(batch.input_ids[q0:q1])
        positions.extend(batch.positions[q0:q1])
        qsl.append(qsl[-1] + q1 - q0)
        seq_lens.append(batch.seq_lens[b])
        tables.append(batch.block_tables[b])
        rows.extend(range(q0, q1))
    return StepBatch(ids, positions, qsl, seq_lens, tables), rows


class KnownCulprits:
    """Requests whose forward failed, as one stage process knows them, and the blocks
    the failed step was writing for them, kept while steps issued before the driver
    learnt of them may still arrive (`horizon` steps: the driver never has more in
    flight; after that the driver has freed those blocks and forgotten their prefix
    entries). A later sequence of a culprit, or one that reads one of those blocks as
    its prefix (a prefix-cache hit taken while the failed step was on the ring), is not
    computed on this stage: its KV there would not be valid."""

    def __init__(self, horizon: int, block_size: int) -> None:
        self.horizon = horizon
        self.block_size = block_size
        self._found_at: dict[str, int] = {}
        self._blocks_at: dict[int, int] = {}

    def skipped(
        self,
        step_id: int,
        batch: StepBatch,
        request_ids: Sequence[str],
        upstream: Sequence[tuple[int, str]],
    ) -> set[int]:
        """Sequences of step `step_id` this stage must not compute."""
        for rid, at in list(self._found_at.items()):
            if step_id >= at + self.horizon:
                del self._found_at[rid]
        for block, at in list(self._blocks_at.items()):
            if step_id >= at + self.horizon:
                del self._blocks_at[block]
        skip = {b for b, _ in upstream}
        skip.update(b for b, rid in enumerate(request_ids) if rid in self._found_at)
        if self._blocks_at:
            for b, table in enumerate(batch.block_tables):
                first = batch.positions[batch.query_start_loc[b]]
                prefix = table[: (first + self.block_size - 1) // self.block_size]
                if any(block in self._blocks_at for block in prefix):
                    skip.add(b)
        return skip

    def remember(
        self, step_id: int, batch: StepBatch, request_ids: Sequence[str], seqs: Sequence[int]
    ) -> None:
        """Sequences `seqs` of step `step_id` failed (here or upstream)."""
        for b in seqs:
            if b < len(request_ids):
                self._found_at.setdefault(request_ids[b], step_id)
            q0, q1 = batch.query_start_loc[b], batch.query_start_loc[b + 1]
            table = batch.block_tables[b]
            for p in batch.positions[q0:q1]:
                self._blocks_at.setdefault(table[p // self.block_size], step_id)


def forward_isolating(
    forward: StageForward,
    batch: StepBatch,
    hidden: torch.Tensor | None,
    skip: set[int],
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, dict[int, str]]:
    """The stage's hidden states of the whole batch [rows, H] (zeros in the rows of
    skipped and failed sequences) and {sequence: error} of the sequences whose forward
    failed here, found by bisection."""
    n = len(batch.seq_lens)
    keep = [b for b in range(n) if b not in skip]

    def run(seqs: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        if len(seqs) == n:
            return forward(seqs, batch, hidden), []
        sub, rows = subset_batch(batch, seqs)
        part = None if hidden is None else hidden[torch.tensor(rows, device=hidden.device)]
        return forward(seqs, sub, part), rows

    found: dict[int, str] = {}
    try:
        out, rows = run(keep) if keep else (None, [])
    except Exception as e:
        at = find_culprits(keep, run, e)
        found = {keep[i]: err for i, err in at.items()}
        rest = [b for b in keep if b not in found]
        out, rows = run(rest) if rest else (None, [])
    if out is not None and len(keep) == n and not found:
        return out, {}
    full = torch.zeros(len(batch.positions), hidden_size, dtype=dtype, device=device)
    if out is not None and rows:
        full[torch.tensor(rows, device=device)] = out
    return full, found


def check_fault(
    faults: EngineFaults | None, stage: int, poisoned: Sequence[int], seqs: Sequence[int]
) -> None:
    """Test-only: raise the injected forward fault on this stage if a poisoned sequence
    is among `seqs` (engine/faults.py)."""
    if faults is None or faults.place != "forward" or faults.stage not in (None, stage):
        return
    if set(poisoned) & set(seqs):
        raise InjectedFault(
            f"injected forward fault on stage {stage}: a request with seed "
            f"{faults.fail_seed} is in the batch (engine_faults.fail_seed, tests only)"
        )


def stage_forward(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    block_size: int,
    faults: EngineFaults | None,
    stage: int,
    poisoned: Sequence[int],
) -> StageForward:
    """The StageForward of one stage's layers (`poisoned`: sequences of the step that
    carry the test-only fault)."""

    def forward(seqs: Sequence[int], batch: StepBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        check_fault(faults, stage, poisoned, seqs)
        ids, positions, meta = batch_tensors(batch, device, block_size)
        out = model(ids, positions, kv_caches, meta, hidden_states=hidden)
        assert isinstance(out, torch.Tensor)
        return out

    return forward

"""A prefill instance's cold start under each admission rule (engine/admission.py), with
the engine's own Scheduler and no model: how many steps, how many tokens computed, how
many preemptions.

The workload is run 8's (docs/benchmarks.md "Seventh and eighth runs"): 32 first turns
of 12K..16K tokens (seeded) arrive at once at a prefill instance with a 32 GiB cache of
an 8B model (262,144 tokens in blocks of 16), a step budget of 8192 tokens and 64
sequences. A finished prompt's blocks are held until its handoff to decode is done:
handoffs go one after the other at `handoff_tokens_per_step` (none: released at once),
which is what makes the cache run short (decode's landing room is the slow side). The
ceiling is the steps of a step budget always full: ceil(prompt tokens / budget).

    python -m benchmarks.prefill_admission [--seed 0] [--sessions 32]

Steps count every schedule() until the last block came back, empty ones included (the
engine polls its connector while blocks are held); a step's time is not modelled.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence

from engine.admission import make_admission
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import ConnectorUpdate, NoConnectorScheduler
from engine.prefill_order import PrefillOrder
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from protocol.hashing import namespace_seed
from protocol.ids import BlockId, RequestId
from protocol.sampling import SamplingParams

BLOCK_SIZE = 16
CACHE_TOKENS = 262_144
BUDGET = 8192
MAX_NUM_SEQS = 64


class SerialHandoff(NoConnectorScheduler):
    """Holds a finished prompt's blocks until its handoff is done; handoffs go one after
    the other at `tokens_per_step` (None: none held)."""

    def __init__(self, tokens_per_step: float | None) -> None:
        self.tokens_per_step = tokens_per_step
        self.now = 0
        self._busy_until = 0.0
        self._release_at: dict[RequestId, float] = {}

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        return ConnectorUpdate()

    def request_finished(self, request: Request, block_ids: list[BlockId]) -> bool:
        if self.tokens_per_step is None or request.status is RequestStatus.WAITING:
            return False  # nothing held, or preempted: nothing sent
        start = max(float(self.now), self._busy_until)
        self._busy_until = start + request.num_prompt_tokens / self.tokens_per_step
        self._release_at[request.request_id] = self._busy_until
        return True

    def tick(self) -> ConnectorUpdate:
        self.now += 1
        done = {r for r, at in self._release_at.items() if at <= self.now}
        for r in done:
            del self._release_at[r]
        return ConnectorUpdate(released=done)


def run(
    lens: list[int], admission: str, order: str, handoff: float | None
) -> tuple[int, int, int, int]:
    """(steps, tokens computed, preemptions, recomputed tokens) of one cold start."""
    root = namespace_seed("prefill-admission")
    sched = Scheduler(
        KVCacheManager(BlockPool(CACHE_TOKENS // BLOCK_SIZE), BLOCK_SIZE),
        BUDGET,
        MAX_NUM_SEQS,
        connector=SerialHandoff(handoff),
        order=PrefillOrder(kind=order),
        admission=make_admission(admission),
    )
    conn = sched.connector
    assert isinstance(conn, SerialHandoff)
    for i, n in enumerate(lens):
        tokens = list(range(i * 100_000, i * 100_000 + n))  # no prefix shared
        req = Request(
            RequestId(f"s{i}"), tokens, SamplingParams(), block_size=BLOCK_SIZE, hash_root=root
        )
        sched.add(req)
    steps = tokens = 0
    while sched.has_work():
        out = sched.schedule()
        steps += 1
        tokens += out.num_tokens
        for s in out.scheduled:
            samples = s.samples
            s.request.num_computed_tokens += s.num_new_tokens
            sched.kv.cache_full_blocks(s.request)
            if samples:
                s.request.append_output(7, None)
                sched.finish(s.request, RequestStatus.FINISHED_STOPPED)
        sched.update_from_connector(conn.tick())
        assert steps < 100_000, "no progress"
    c = sched.counters
    return steps, tokens, c.preemptions, c.recomputed_tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill_admission")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=32)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    lens = [rng.randint(12_000, 16_000) for _ in range(args.sessions)]
    ceiling = math.ceil(sum(lens) / BUDGET)
    print(
        f"{args.sessions} prompts, {sum(lens)} tokens; cache {CACHE_TOKENS} tokens; "
        f"budget {BUDGET}; ceiling {ceiling} steps"
    )
    print(
        "| order | handoff tokens/step | admission | steps | computed | preemptions | recomputed |"
    )
    print("|---|---|---|---|---|---|---|")
    for order in ("shortest", "fcfs"):
        for handoff in (None, 16384.0, 8192.0, 4096.0, 2048.0):
            for admission in ("chunk", "whole_prompt"):
                steps, tokens, preemptions, recomputed = run(lens, admission, order, handoff)
                rate = "none held" if handoff is None else f"{handoff:.0f}"
                print(
                    f"| {order} | {rate} | {admission} | {steps} | {tokens} | {preemptions} "
                    f"| {recomputed} |"
                )


if __name__ == "__main__":
    main()

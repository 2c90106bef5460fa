"""Torch threads per engine step on the CPU: fewer for steps that only decode.

A decode step at a few rows is bound by memory bandwidth (every weight and every cached
key and value read once per step), and one core already draws most of what this class
of machine gives: on the 2-core dev VM one thread reads ~30 GB/s, two ~30-37, and a
SmolLM2 decode step took as long on two threads as on one while burning twice the CPU
(docs/benchmarks.md, "Decode steps on one thread"). Its OpenMP barriers also make
every step wait for the slowest thread, so any other work on a core the engine
shares (the router streaming tokens, the worker's event loop, the clients on a small
box) stalls the whole step. Prefill chunks are compute-bound and do scale with threads.

So an engine that owns every CPU of a small host runs steps with prefill rows on all
its threads and pure-decode steps on fewer, leaving the rest to the work around it, as
vLLM's CPU backend keeps a core for its API server. `torch.set_num_threads` is cheap
and is only called when the kind of step changes.
"""

from __future__ import annotations

import torch

from engine.scheduler import SchedulerOutput


class StepThreads:
    """Sets torch's intra-op thread count before each step: `decode` threads when every
    scheduled row is a single token (decode), `full` otherwise."""

    def __init__(self, full: int, decode: int) -> None:
        if full < 1 or decode < 1:
            raise ValueError(f"thread counts must be >= 1, got full={full} decode={decode}")
        self.full = full
        self.decode = min(decode, full)

    def threads_for(self, plan: SchedulerOutput) -> int:
        if all(s.num_new_tokens == 1 for s in plan.scheduled):
            return self.decode
        return self.full

    def before_step(self, plan: SchedulerOutput) -> None:
        """Called on the thread that runs the step (OpenMP's count is per thread)."""
        want = self.threads_for(plan)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

"""Injected engine faults, for tests of a failing request only (cluster.yaml
`prefill[].engine_faults` / `decode[].engine_faults`; off by default). A request is
poisoned by its sampling seed, which travels with it to every process that samples
(the driver, or a pipeline's last stage) and never changes its greedy tokens. A fault
raises (a failing request) or, with `hang_s`, blocks the step (a stuck engine)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Literal

import msgspec

from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

FaultPlace = Literal["sample", "forward"]


class InjectedFault(RuntimeError):
    """Raised by EngineFaults where a real per-request failure would be raised."""


class EngineFaults(msgspec.Struct, frozen=True, kw_only=True):
    """Fail every step that holds a request with `seed == fail_seed`, at `place`:
    "sample" (the batched sampler raises, as a sampling parameter the sampler cannot
    compute did) or "forward" (the batched model forward raises)."""

    fail_seed: int
    place: FaultPlace = "sample"
    stage: int | None = None
    """"forward" on a prefill pipeline: the one stage whose forward raises (None: each)."""
    rank: int | None = None
    """"forward" on a TP x DCP instance: the one rank that raises, inside its forward
    before layer `layer`, while the others run on (None: every rank alike, before the
    forward, as a request's input makes every rank fail)."""
    layer: int = 0
    hang_s: float = 0.0
    """> 0: a poisoned step does not raise but sleeps this long where it would have
    raised (a step that does not return: a stuck kernel, a wedged rank or pipeline
    stage), for the stall watchdog's tests (enginehost/host.py). Taken where `check`
    runs: "sample" (the driver's sampler, or a pipeline's last stage) and a
    single-process "forward"."""

    def poisoned(self, params: Iterable[SamplingParams]) -> list[int]:
        """Indices of the poisoned requests among `params` (for "forward" faults raised
        in another process than the one that sees the requests' parameters)."""
        return [i for i, p in enumerate(params) if p.seed == self.fail_seed]

    def check(self, place: FaultPlace, params: Iterable[SamplingParams]) -> None:
        """Raise InjectedFault (or hang for `hang_s`) if this is the place and a
        poisoned request is here."""
        if place == self.place and any(p.seed == self.fail_seed for p in params):
            if self.hang_s > 0:
                log.warning(
                    "injected %s hang: %g s (engine_faults, tests only)", place, self.hang_s
                )
                time.sleep(self.hang_s)
                return
            raise InjectedFault(
                f"injected {place} fault: a request with seed {self.fail_seed} is in "
                "the batch (engine_faults.fail_seed, tests only)"
            )

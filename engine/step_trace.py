"""StepTrace: an opt-in JSON-lines record of an engine's steps and its requests' milestones.

Where a request's time to first token goes on a CPU instance is a question of order:
how long it waited for the step in flight, how many prefill steps it took, of what size,
beside which decode rows, and how long the first token took to leave the process. With
`KVSERVE_STEP_TRACE=DIR` in an engine process's environment (a cluster file's instance
`env:`), the engine writes one line per step and the worker one line per milestone to
DIR/<instance>-<pid>.jsonl; benchmarks/unified_timeline.py joins them. Unset (the
default), nothing is recorded and a step pays one `is None` check.

Lines (times: time.monotonic(), one clock for every process of the host):

    {"k": "step", "t0", "sched", "exec", "end", "cpu", "rows": [[rid, new, computed, samples]]}
        t0 schedule() starts, sched it returned, exec the forward (and the connector's
        workers) returned, end the outputs are built; cpu: the engine thread's CPU clock at
        end; rows: each scheduled request, its new tokens, its tokens computed before the
        step, whether it samples
    {"k": "req", "ev": "arrival" | "added" | "first_token", "rid", "t"}
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO

import msgspec

ENV = "KVSERVE_STEP_TRACE"

Row = tuple[str, int, int, bool]


class StepRecord(msgspec.Struct, tag="step", tag_field="k"):
    t0: float
    sched: float
    exec: float
    end: float
    cpu: float
    rows: list[Row]


class RequestEvent(msgspec.Struct, tag="req", tag_field="k"):
    ev: str
    rid: str
    t: float


TraceLine = StepRecord | RequestEvent


class StepTrace:
    """Owns one open trace file; the engine thread writes steps, the event loop request
    events (each write is one whole line: a single write call on a line-buffered file)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 (closed in close)
        self._enc = msgspec.json.Encoder()

    @classmethod
    def from_env(cls, name: str) -> StepTrace | None:
        """The trace of instance `name` when KVSERVE_STEP_TRACE names a directory; else None."""
        where = os.environ.get(ENV)
        if not where:
            return None
        return cls(Path(where) / f"{name}-{os.getpid()}.jsonl")

    def step(self, t0: float, sched: float, exec_: float, rows: list[Row]) -> None:
        """One step (engine thread): its phases' ends, now its end."""
        rec = StepRecord(t0, sched, exec_, time.monotonic(), time.thread_time(), rows)
        self._file.write(self._enc.encode(rec) + b"\n")

    def request(self, ev: str, rid: str) -> None:
        """A request's milestone, now."""
        self._file.write(self._enc.encode(RequestEvent(ev, rid, time.monotonic())) + b"\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: Path) -> list[TraceLine]:
    """Every line of a trace file (a torn last line, from a killed process, is skipped)."""
    dec = msgspec.json.Decoder(TraceLine)
    out: list[TraceLine] = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(dec.decode(line))
        except msgspec.DecodeError:
            continue
    return out

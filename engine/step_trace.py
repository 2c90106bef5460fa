"""StepTrace: an opt-in JSON-lines record of an engine's steps and its requests' milestones.

Where a request's time to first token goes on a CPU instance is a question of order:
how long it waited for the step in flight, how many prefill steps it took, of what size,
beside which decode rows, and how long the first token took to leave the process. With
`KVSERVE_STEP_TRACE=DIR` in an engine process's environment (a cluster file's instance
`env:`; unified, prefill and decode instances alike), the engine writes one line per step
and the worker one line per milestone to DIR/<instance>-<pid>.jsonl;
benchmarks/unified_timeline.py and benchmarks/serving_timeline.py read them. Unset (the
default), nothing is recorded and a step pays one `is None` check.

Lines (times: time.monotonic(), one clock for every process of the host):

    {"k": "step", "t0", "sched", "exec", "end", "cpu", "rows": [[rid, new, computed, samples]],
     "cpu0", "pre", "queued", "past_prompt"}
        t0 schedule() starts, sched it returned, exec the forward (and the connector's
        workers) returned, end the outputs are built; cpu0 / cpu: the engine thread's CPU
        clock at t0 / end (wall far above CPU: the thread waited, on the GIL or a blocking
        call); rows: each scheduled request, its new tokens, its tokens computed before
        the step, whether it samples; pre: requests this schedule preempted; queued:
        requests left waiting or loading KV after it; past_prompt: rows whose prompt was
        computed before the step (decode rows)
    {"k": "req", "ev", "rid", "t"}   a request's milestone, ev one of MILESTONES
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import msgspec

ENV = "KVSERVE_STEP_TRACE"

Row = tuple[str, int, int, bool]

MILESTONES = {
    "arrival": "the request reached the worker (its HTTP handler started)",
    "added": "the engine took it (add_request returned)",
    "granted": "prefill: decode's landing came (a LandingGrant, for a request sent beside "
    "decode's)",
    "kv_loaded": "its external KV is in (a pool restore, decode's landing and first token "
    "from prefill): it computes from here",
    "first_token": "its first line of tokens left the worker (prefill, unified: the first "
    "token; decode: the first token it sampled itself)",
    "prefill_token": "decode: prefill's first token reached it",
    "handoff_done": "prefill: every stage closed its handoff flow (sent, or failed)",
}
"""Every request milestone a trace holds, in the order a request meets those of its worker."""


class StepRecord(msgspec.Struct, tag="step", tag_field="k"):
    t0: float
    sched: float
    exec: float
    end: float
    cpu: float
    rows: list[Row]
    cpu0: float = -1.0
    """-1: a trace from before cpu0 was recorded."""
    pre: int = 0
    queued: int = 0
    past_prompt: int = 0


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

    def step(
        self,
        t0: float,
        cpu0: float,
        sched: float,
        exec_: float,
        rows: list[Row],
        *,
        pre: int = 0,
        queued: int = 0,
        past_prompt: int = 0,
    ) -> None:
        """One step (engine thread): its start on both clocks, its phases' ends, now its end."""
        rec = StepRecord(
            t0,
            sched,
            exec_,
            time.monotonic(),
            time.thread_time(),
            rows,
            cpu0,
            pre,
            queued,
            past_prompt,
        )
        self._file.write(self._enc.encode(rec) + b"\n")

    def request(self, ev: str, rid: str) -> None:
        """A request's milestone (one of MILESTONES), now; any thread."""
        assert ev in MILESTONES, ev
        self._file.write(self._enc.encode(RequestEvent(ev, rid, time.monotonic())) + b"\n")

    def close(self) -> None:
        self._file.close()


def _untraced(_ev: str, _rid: str) -> None:
    pass


def milestones(trace: StepTrace | None) -> Callable[[str, str], None]:
    """How a worker records its requests' milestones: `trace.request`, or a do-nothing
    recorder when the instance is not traced."""
    return trace.request if trace is not None else _untraced


def read_trace(path: Path) -> list[TraceLine]:
    """Every line of a trace file, gzipped (.gz) or not (a torn last line, from a killed
    process, is skipped)."""
    dec = msgspec.json.Decoder(TraceLine)
    out: list[TraceLine] = []
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    for line in data.splitlines():
        try:
            out.append(dec.decode(line))
        except msgspec.DecodeError:
            continue
    return out

"""Agent traces: the data model, the JSONL format we accept, and the trace ceiling.

A trace is sessions of threads (a main agent thread and its subagents); a thread is a
list of requests sent one after another (closed loop). Each request's input is a list of
block hash ids: equal ids at the same position are the same tokens, and since ids are
per position in a prefix chain, two requests share a prefix exactly as far as their ids
agree (the AgentX / Weka / Mooncake trace convention).

JSONL format (one JSON object per line, `#` lines and blank lines ignored):

    {"type": "header", "block_tokens": 64, "source": "..."}          optional, first line
    {"session": "s0", "thread": "main", "hash_ids": [0, 1, 2, ...],
     "input_length": 4096, "output_length": 200, "wait_s": 12.5,
     "parent": null, "spawn_after": null, "join": []}

    session        session id (aliases: session_id, conversation_id)
    thread         thread id within the session (aliases: thread_id, agent_id; default
                   "main"); requests of a thread are in file order
    hash_ids       input as block hash ids of `block_tokens` tokens each
    input_length   prompt tokens (default len(hash_ids) x block_tokens; aliases
                   input_tokens); the last block may be partial
    output_length  tokens to generate (aliases: output_tokens); replayed with ignore_eos
    wait_s         pause before sending, after the thread's previous request finished
                   (tool / user / subagent time; aliases: delay_s, think_time_s); capped at
                   MAX_WAIT_S. Without it, gaps between `timestamp` (s) values are used.
    parent,        a subagent thread: started when request `spawn_after` (0-based index)
    spawn_after    of thread `parent` of the same session has finished (first line of the
                   thread only)
    join           thread ids of the same session this request waits for (a main thread
                   resuming after its subagents)

Waits are multiplied by a time-scale factor at replay.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_WAIT_S = 300.0


@dataclass
class TraceRequest:
    hash_ids: list[int]
    input_length: int
    output_length: int
    wait_s: float = 0.0
    join: list[str] = field(default_factory=list)


@dataclass
class TraceThread:
    session: str
    thread: str
    requests: list[TraceRequest] = field(default_factory=list)
    parent: str | None = None
    spawn_after: int | None = None

    @property
    def key(self) -> str:
        return f"{self.session}/{self.thread}"


@dataclass
class Trace:
    block_tokens: int
    threads: list[TraceThread]
    source: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(t.requests) for t in self.threads)

    @property
    def sessions(self) -> list[str]:
        return list(dict.fromkeys(t.session for t in self.threads))


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def read_trace(path: str | Path, *, default_block_tokens: int = 512) -> Trace:
    """Parse a JSONL trace (module docstring); ValueError naming the line on bad input."""
    return parse_trace(Path(path).read_text().splitlines(), str(path), default_block_tokens)


def parse_trace(lines: Iterable[str], source: str = "", default_block_tokens: int = 512) -> Trace:
    block_tokens = default_block_tokens
    threads: dict[tuple[str, str], TraceThread] = {}
    last_ts: dict[tuple[str, str], float] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
            if d.get("type") == "header":
                block_tokens = int(d.get("block_tokens", block_tokens))
                continue
            session = str(_first(d, "session", "session_id", "conversation_id", default="s0"))
            thread = str(_first(d, "thread", "thread_id", "agent_id", default="main"))
            ids = [int(x) for x in d["hash_ids"]]
            n_in = int(_first(d, "input_length", "input_tokens", default=len(ids) * block_tokens))
            if not 0 < n_in <= len(ids) * block_tokens:
                raise ValueError(f"input_length {n_in} does not fit {len(ids)} blocks")
            n_out = int(_first(d, "output_length", "output_tokens", default=1))
            wait = _first(d, "wait_s", "delay_s", "think_time_s")
            key = (session, thread)
            ts = _first(d, "timestamp")
            if wait is None and ts is not None and key in last_ts:
                wait = float(ts) - last_ts[key]
            if ts is not None:
                last_ts[key] = float(ts)
            req = TraceRequest(
                ids,
                n_in,
                max(1, n_out),
                min(MAX_WAIT_S, max(0.0, float(wait or 0.0))),
                [str(j) for j in d.get("join") or []],
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{source or 'trace'}:{lineno}: {e}") from None
        t = threads.get(key)
        if t is None:
            parent = d.get("parent")
            t = threads[key] = TraceThread(
                session,
                thread,
                parent=None if parent is None else str(parent),
                spawn_after=d.get("spawn_after"),
            )
        t.requests.append(req)
    return Trace(block_tokens, list(threads.values()), source)


def write_trace(trace: Trace, path: str | Path) -> None:
    """The JSONL form of `trace` (read_trace reads it back equal)."""
    with open(path, "w") as f:
        f.write(json.dumps({"type": "header", "block_tokens": trace.block_tokens}) + "\n")
        for line in trace_lines(trace):
            f.write(line + "\n")


def trace_lines(trace: Trace) -> Iterator[str]:
    for t in trace.threads:
        for i, r in enumerate(t.requests):
            d: dict[str, Any] = {
                "session": t.session,
                "thread": t.thread,
                "hash_ids": r.hash_ids,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "wait_s": round(r.wait_s, 3),
            }
            if i == 0 and t.parent is not None:
                d["parent"], d["spawn_after"] = t.parent, t.spawn_after
            if r.join:
                d["join"] = r.join
            yield json.dumps(d, separators=(",", ":"))


class CeilingCounter:
    """Reuse a perfect infinite prefix cache would get, fed requests in the order they
    were sent: each request reuses its longest prefix of blocks seen before (at trace
    block granularity, and never its last token: that one is always computed)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._seen: set[tuple[int, int]] = set()
        """(hash of the prefix before the block, block id): the chain of ids."""
        self.prompt_tokens = 0
        self.reused_tokens = 0

    def add(self, hash_ids: list[int], input_length: int) -> int:
        parent = 0
        matched = 0
        still = True
        num_full = min(len(hash_ids), input_length // self.block_tokens)
        for i, h in enumerate(
            hash_ids[: (input_length + self.block_tokens - 1) // self.block_tokens]
        ):
            key = (parent, h)
            if still and i < num_full and key in self._seen:
                matched += 1
            else:
                still = False
            if i < num_full:
                self._seen.add(key)
            parent = hash(key)
        reused = min(matched * self.block_tokens, input_length - 1)
        self.prompt_tokens += input_length
        self.reused_tokens += reused
        return reused

    @property
    def ceiling(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

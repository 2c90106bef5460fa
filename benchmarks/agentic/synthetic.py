"""Seeded synthetic agent sessions with the published shape of coding-agent traces
(DESIGN §1: AgentX, recorded Claude Code sessions), scalable down for CPU runs.

Full scale (max_context = 170K tokens), per session:
- a system prompt + tool definitions shared by every session (~6% of max context);
- the main thread starts near 40K tokens of context and grows toward 170K: each turn
  appends the previous output plus ~1-2K new tokens (tool results, user text);
- waits between turns are tool / user time, log-normal from seconds to minutes (median
  ~8 s), capped at 300 s;
- now and then (p = 0.08 per turn) a 4-way fan-out of subagents: each starts from its own
  shared subagent prompt plus a task, runs 2-4 turns, and the main thread resumes when
  all four are done (`join`);
- now and then (p = 0.03 per turn) a history rewrite: the history is edited partway (at
  50-90% of its length) and everything after that point changes, so the chain diverges
  there; when the context passes max_context the agent compacts: the history after the
  shared prefix becomes a summary a third as long.

Everything measured in tokens scales by max_context / 170K (never below one block), so
`--max-context 3000` gives the same shape with contexts up to ~3K tokens. Hash ids are
unique per (session, position) unless shared on purpose: the ceiling is a property of
the trace, not of chance collisions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.agentic.trace import MAX_WAIT_S, Trace, TraceRequest, TraceThread

FULL_CONTEXT = 170_000


@dataclass(frozen=True)
class SyntheticShape:
    """Knobs of the generator, at full scale (tokens) before scaling."""

    system_tokens: int = 10_000
    start_context: int = 40_000
    new_tokens: tuple[int, int] = (1000, 2000)
    output_tokens: tuple[int, int] = (150, 600)
    wait_median_s: float = 8.0
    wait_sigma: float = 1.3
    fanout_p: float = 0.08
    fanout_width: int = 4
    subagent_turns: tuple[int, int] = (2, 4)
    subagent_prompt_tokens: int = 6_000
    subagent_task_tokens: tuple[int, int] = (2_000, 6_000)
    rewrite_p: float = 0.03


class _Ids:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def generate(
    *,
    sessions: int,
    turns: int,
    max_context: int = FULL_CONTEXT,
    seed: int = 0,
    block_tokens: int = 64,
    shape: SyntheticShape | None = None,
    max_output_tokens: int | None = None,
) -> Trace:
    """`sessions` sessions of `turns` main-thread turns each (plus subagent turns)."""
    sh = shape or SyntheticShape()
    rng = random.Random(seed)
    scale = max_context / FULL_CONTEXT

    def blocks(tokens: float) -> int:
        return max(1, round(tokens * scale / block_tokens))

    def tokens_between(lo_hi: tuple[int, int]) -> int:
        return blocks(rng.uniform(*lo_hi))

    def out_len() -> int:
        n = max(4, round(rng.uniform(*sh.output_tokens) * scale))
        return min(n, max_output_tokens) if max_output_tokens else n

    def wait() -> float:
        return min(MAX_WAIT_S, rng.lognormvariate(0.0, sh.wait_sigma) * sh.wait_median_s)

    ids = _Ids()
    system = ids.take(blocks(sh.system_tokens))
    sub_system = ids.take(blocks(sh.subagent_prompt_tokens))
    max_blocks = max_context // block_tokens
    threads: list[TraceThread] = []
    for s in range(sessions):
        name = f"s{s}"
        main = TraceThread(name, "main")
        threads.append(main)
        history = system + ids.take(max(1, blocks(sh.start_context) - len(system)))
        join: list[str] = []
        num_fanouts = 0
        for turn in range(turns):
            if len(history) > max_blocks:  # the agent compacts when the window is full
                history = _rewrite(history, len(system), ids)
            n_out = out_len()
            main.requests.append(
                TraceRequest(
                    list(history),
                    len(history) * block_tokens,
                    n_out,
                    0.0 if turn == 0 else wait(),
                    join,
                )
            )
            join = []
            if turn + 1 < turns and rng.random() < sh.fanout_p:
                num_fanouts += 1
                for k in range(sh.fanout_width):
                    sub = TraceThread(
                        name, f"sub{num_fanouts}.{k}", parent="main", spawn_after=turn
                    )
                    ctx = sub_system + ids.take(tokens_between(sh.subagent_task_tokens))
                    for t in range(rng.randint(*sh.subagent_turns)):
                        sub.requests.append(
                            TraceRequest(
                                list(ctx),
                                len(ctx) * block_tokens,
                                out_len(),
                                0.0 if t == 0 else wait() / 4,
                            )
                        )
                        ctx = ctx + ids.take(blocks(n_out) + tokens_between(sh.new_tokens))
                    threads.append(sub)
                    join.append(sub.thread)
            # Next turn: this turn's output and the new tool results / user text.
            history = history + ids.take(blocks(n_out) + tokens_between(sh.new_tokens))
            if rng.random() < sh.rewrite_p:
                cut = max(len(system), int(len(history) * rng.uniform(0.5, 0.9)))
                history = history[:cut] + ids.take(len(history) - cut)
    return Trace(block_tokens, threads, f"synthetic(seed={seed}, max_context={max_context})")


def _rewrite(history: list[int], keep: int, ids: _Ids) -> list[int]:
    """Compaction: the shared prefix stays, the rest becomes a third as long, new ids."""
    return history[:keep] + ids.take(max(1, (len(history) - keep) // 3))

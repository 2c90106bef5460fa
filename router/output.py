"""Worker tokens -> client-visible text deltas, and the request's timing for metrics.

The router's text is the truth the client sees: modelinfo's RequestOutputText applies
EOS, stop token ids, stop strings (holding back a possible stop prefix) and max_tokens.
Workers apply the same rules; if one finishes for a reason the router did not see, its
reason wins and the held-back text is flushed (RequestOutputText.finish). If the router finishes first (a stop string
the worker has not matched yet), iteration ends and the run aborts the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from modelinfo.detokenizer import RequestOutputText
from router.relay import RequestRun, WorkerTokens

_V = TypeVar("_V")


@dataclass(slots=True)
class OutputDelta:
    """What to send the client next: new text, the tokens behind it, their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Per token, (token id, logprob) alternatives when the request asked for them."""


@dataclass
class RequestTiming:
    """Monotonic timestamps of one request (seconds), for TTFT / ITL / E2E."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    """Inter-token latencies: a batch of k tokens after a gap g adds k entries of g / k."""

    def on_tokens(self, num_tokens: int) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            num_tokens -= 1
        elif self.last_token is not None and num_tokens > 0:
            gap = (now - self.last_token) / num_tokens
            self.token_gaps.extend([gap] * num_tokens)
        self.last_token = now


class OutputStream:
    """Owns one request's RequestOutputText; turns `run.events()` into OutputDeltas.

    The RequestOutputText (its detokenizer primed with the prompt's last tokens) is built
    by `make_text` while the run waits for its first worker answer, not before the run's
    first call: that work is then off the request's critical path."""

    def __init__(
        self,
        run: RequestRun,
        make_text: Callable[[], RequestOutputText],
        timing: RequestTiming,
    ) -> None:
        self.run = run
        self._make_text = make_text
        self._text: RequestOutputText | None = None
        self.timing = timing
        self.finish_reason: str | None = None

    @property
    def text(self) -> RequestOutputText:
        if self._text is None:
            self._text = self._make_text()
        return self._text

    def _build_text(self) -> None:
        # A failure here is raised again, in the request, where the text is first used.
        with contextlib.suppress(Exception):
            _ = self.text

    @property
    def num_output_tokens(self) -> int:
        return self._text.num_output_tokens if self._text is not None else 0

    async def deltas(self) -> AsyncGenerator[OutputDelta, None]:
        """Deltas until a finish; the last one carries the finish reason. Closing this
        generator closes the run's event stream (which aborts the workers if unfinished)."""
        # Runs once this task first waits on a worker (the loop's next turn).
        events = self.run.events()
        build = asyncio.get_running_loop().call_soon(self._build_text)
        try:  # what `async with aclosing(...)` does, without its three Python calls
            async for batch in events:
                delta = self._convert(batch)
                yield delta
                if delta.finish_reason is not None:
                    self.finish_reason = delta.finish_reason
                    return
        finally:
            try:
                await events.aclose()
            finally:
                build.cancel()

    def _convert(self, batch: WorkerTokens) -> OutputDelta:
        token_ids = batch.token_ids
        self.timing.on_tokens(len(token_ids))
        # the batch's tokens in one call (RequestOutputText.extend), up to a finish
        text, by_rules, taken = self.text.extend(token_ids)
        finish: str | None = by_rules
        if taken < len(token_ids):
            token_ids = token_ids[:taken]
        logprobs = batch.logprobs
        logprobs = list(logprobs) if len(logprobs) == taken else _fit(logprobs, taken)
        top = batch.top_logprobs
        tops: list[list[tuple[int, float]] | None] = (
            [None] * taken if top is None else _fit(top, taken)
        )
        if finish is None and batch.finish_reason is not None:
            # The worker finished for a reason the router's rules did not see (yet).
            worker = batch.finish_reason
            rest = self.text.finish("length" if worker == "length" else "stop")
            text += rest.text
            finish = rest.finish_reason if worker in ("stop", "length") else worker
        elif finish is not None and batch.finish_reason is None:
            self.run.finish_early()
        return OutputDelta(text, list(token_ids), logprobs, finish, tops)


def _fit(values: Sequence[_V | None], n: int) -> list[_V | None]:
    """`values` cut or padded with None to `n` entries (a worker may send fewer)."""
    if len(values) == n:
        return list(values)
    return [*values[:n], *([None] * (n - len(values)))]

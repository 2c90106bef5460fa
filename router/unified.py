"""One request's trip through a unified instance: one worker call, no handoff.

    pick unified ─GenerateRequest─▶ unified   restores history from the pool, prefills
                                               (chunked, mixed with others' decodes) and
                                               decodes in one engine
                 ◀─ FirstToken                 with the prompt's usage (gpu / pool /
                                               computed), yielded at once
                 ◀─ TokenBatch ...             until one carries a finish_reason

The run keeps everything RequestRun (router/relay.py) promises: the instance is chosen by
the routing policy as a prefill would be (prefix-, pool- and load-priced with kv_aware,
session affinity with session; the ClusterView counts the prompt as the instance's queued
work until its first token and records the prompt's blocks as resident after it), an
instance that cannot be connected to is marked unhealthy and another one is tried, a
worker that breaks mid-stream is marked unhealthy, and a run that fails or is left (client
gone, timeout, a stop string the router matched first) aborts the instance in the
background. No admission gate: a unified instance lands no handed-off KV, its own
scheduler preempts when its KV is short, as a single-process engine does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from protocol.messages import (
    PROTOCOL_VERSION,
    ErrorEvent,
    FirstToken,
    GenerateRequest,
    TokenBatch,
)
from router.errors import WorkerError, WorkerFailed
from router.relay import RequestRun, RunEnd, WorkerTokens
from router.worker_client import InstanceUnreachable


class UnifiedRun(RequestRun):
    """A RequestRun whose serving path is one call to a unified instance."""

    async def _run(self) -> AsyncGenerator[WorkerTokens, None]:
        with RunEnd(self):
            prompt = list(self.ctx.prompt_token_ids)
            req = GenerateRequest(
                version=PROTOCOL_VERSION,
                request_id=self.request_id,
                prompt_token_ids=prompt,
                params=self.params,
            )
            view = self._s.view
            tried: set[str] = set()
            while True:
                inst = self._pick("unified", tried)
                self.prefill = inst  # the instance that prefilled: usage, logs
                self.decode = inst
                self._start(inst)
                view.on_prefill_sent(
                    inst, self.request_id, self.ctx.predicted_compute_tokens or len(prompt)
                )
                first_seen = False
                events = self._s.client.generate(inst, req, self.deadline)
                next_event = events.__anext__
                try:
                    while True:
                        try:
                            event = await next_event()
                        except StopAsyncIteration:
                            break
                        except WorkerFailed as e:  # the worker broke mid-stream
                            self._broken(inst, e)
                            raise
                        if isinstance(event, ErrorEvent):
                            raise WorkerError(event.status, event.message)
                        if isinstance(event, FirstToken):
                            if first_seen:
                                raise WorkerFailed(f"{inst.describe()} sent a second FirstToken")
                            first_seen = True
                            self.usage = event.usage
                            self._prefilled(inst, event.usage)
                            top: list[list[tuple[int, float]] | None] | None = None
                            if event.top_logprobs is not None:
                                top = [event.top_logprobs]
                            tokens = WorkerTokens(
                                [event.token_id], [event.logprob], event.finish_reason, top
                            )
                        else:
                            assert isinstance(event, TokenBatch)
                            if not first_seen:
                                raise WorkerFailed(
                                    f"{inst.describe()} sent tokens before FirstToken"
                                )
                            tokens = WorkerTokens(
                                event.token_ids,
                                event.logprobs,
                                event.finish_reason,
                                event.top_logprobs,
                            )
                        if tokens.finish_reason is not None:
                            self._done(inst)
                            self._completed = True
                        yield tokens
                        if tokens.finish_reason is not None:
                            return
                    raise WorkerFailed(
                        f"{inst.describe()} ended its stream without a finish_reason"
                    )
                except InstanceUnreachable as e:
                    assert not first_seen
                    self._forget(inst, e, tried)
                finally:
                    try:
                        await events.aclose()  # type: ignore[attr-defined]
                    finally:
                        if not first_seen:
                            view.on_prefill_done(inst, self.request_id, [], None, None)

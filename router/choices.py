"""The n choices of one request: each a RequestRun of its own, answered together.

Choice 0 starts alone; once its first token is back, the prompt's KV is in the prefix
cache of the prefill instance that served it, and choices 1..n-1 start together (the KV-
aware policy sends them to that instance: they share the prompt's KV instead of
computing it again). A seeded request's choice i samples with seed + i, so the choices
differ as OpenAI's do while each stays reproducible; at temperature 0 they are equal.

Whole responses collect every choice; streams interleave the choices' chunks as they
come (each chunk names its choice's index), then the usage chunk and [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from protocol.messages import PromptUsage
from router.errors import APIError, WorkerFailed
from router.openai_format import DONE, ResponseFormatter, full_response, sse
from router.output import OutputDelta, OutputStream
from router.preprocess import PreparedRequest

_SEED_MOD = 2**64


@dataclass
class Choice:
    stream: OutputStream
    deltas: AsyncGenerator[OutputDelta, None]
    first: OutputDelta
    fmt: ResponseFormatter


def choice_request(req: PreparedRequest, index: int) -> PreparedRequest:
    """Choice `index`'s request: its own worker request id, seed + index when seeded."""
    if index == 0:
        return req
    params = req.params
    if params.seed is not None:
        seed = (params.seed + index) % _SEED_MOD
        if seed >= 2**63:  # keep it in the signed range the API accepts
            seed -= _SEED_MOD
        params = msgspec.structs.replace(params, seed=seed)
    clone = PreparedRequest(**{**req.__dict__, "params": params})
    clone.request_id = f"{req.request_id}-{index}"
    return clone


async def first_delta(deltas: AsyncGenerator[OutputDelta, None]) -> OutputDelta:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        raise WorkerFailed("the workers ended the request without any token") from None


async def open_rest(
    req: PreparedRequest,
    open_choice: Callable[[int], tuple[OutputStream, ResponseFormatter]],
    choices: list[Choice],
) -> None:
    """Start choices 1..n-1 together and await each one's first delta (appended to
    `choices` as they open, so a failure still closes the ones already open)."""
    opened = []
    for index in range(1, req.n):
        stream, fmt = open_choice(index)
        opened.append((stream, fmt, stream.deltas()))
    try:
        firsts = await asyncio.gather(*(first_delta(d) for _, _, d in opened))
    except BaseException:
        for _, _, d in opened:
            await d.aclose()
        raise
    for (stream, fmt, deltas), first in zip(opened, firsts, strict=True):
        choices.append(Choice(stream, deltas, first, fmt))


def num_output_tokens(choices: list[Choice]) -> int:
    return sum(c.stream.num_output_tokens for c in choices)


def usage_of(choices: list[Choice]) -> PromptUsage | None:
    """The prompt's usage as the first choice's prefill reported it (the prompt counts
    once, however many choices share it)."""
    return choices[0].stream.run.usage


async def full_body(choices: list[Choice]) -> bytes:
    """Every choice to its end, then the whole response."""

    async def drain(choice: Choice) -> str | None:
        delta = choice.first
        choice.fmt.add_delta(delta)
        finish = delta.finish_reason
        while finish is None:
            delta = await anext(choice.deltas, None)  # type: ignore[arg-type]
            if delta is None:
                raise WorkerFailed("the workers ended the stream without a finish reason")
            choice.fmt.add_delta(delta)
            finish = delta.finish_reason
        return finish

    if len(choices) == 1:  # the common case: no task for gather to wrap the drain in
        finishes = [await drain(choices[0])]
    else:
        finishes = await asyncio.gather(*(drain(c) for c in choices))
    return full_response(
        [c.fmt for c in choices], list(finishes), num_output_tokens(choices), usage_of(choices)
    )


async def stream_body(req: PreparedRequest, choices: list[Choice]) -> AsyncIterator[bytes]:
    """SSE chunks of every choice as they come, then usage (if asked) and [DONE].
    Raises APIError from a failing choice (the caller turns it into an error event)."""
    if len(choices) == 1:  # the common case: no pump task, no queue hop per delta
        async for chunk in _one_choice_body(req, choices[0]):
            yield chunk
        return
    queue: asyncio.Queue[tuple[int, OutputDelta | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, choice: Choice) -> None:
        try:
            async for delta in choice.deltas:
                await queue.put((k, delta))
                if delta.finish_reason is not None:
                    return
            await queue.put((k, None))
        except BaseException as e:
            await queue.put((k, e))

    heads = b"".join(c.fmt.stream_start() for c in choices)
    pending: list[bytes] = [heads]
    done = 0
    for choice in choices:
        pending.append(choice.fmt.stream_delta(choice.first))
        done += choice.first.finish_reason is not None
    tasks = [
        asyncio.create_task(pump(k, c))
        for k, c in enumerate(choices)
        if c.first.finish_reason is None
    ]
    try:
        while done < len(choices):
            chunk = b"".join(pending)
            pending = []
            if chunk:
                yield chunk
            k, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                raise WorkerFailed("the workers ended the stream without a finish reason")
            pending.append(choices[k].fmt.stream_delta(item))
            done += item.finish_reason is not None
        if req.include_usage:
            usage = choices[0].fmt.stream_usage(num_output_tokens(choices), usage_of(choices))
            pending.append(usage)
        yield b"".join(pending) + DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one_choice_body(req: PreparedRequest, choice: Choice) -> AsyncIterator[bytes]:
    fmt = choice.fmt
    chunk = fmt.stream_start() + fmt.stream_delta(choice.first)
    finish = choice.first.finish_reason
    while finish is None:
        yield chunk
        delta = await anext(choice.deltas, None)  # type: ignore[arg-type]
        if delta is None:
            raise WorkerFailed("the workers ended the stream without a finish reason")
        chunk = fmt.stream_delta(delta)
        finish = delta.finish_reason
    if req.include_usage:
        chunk += fmt.stream_usage(num_output_tokens([choice]), usage_of([choice]))
    yield chunk + DONE


def error_event(error: APIError) -> bytes:
    return sse(error.body()) + DONE

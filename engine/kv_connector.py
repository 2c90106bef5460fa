"""KVConnector: the engine's seam to an external KV store (the prefill worker's pool).

The engine never imports the pool. A worker hands the engine a KVConnector; "off" is
`NoKVConnector`, which does nothing. Every method runs in the engine thread; a connector
does its I/O on its own threads and reports back through `finished_loads`.

Life of a request with an external hit (all token counts are prompt positions):

    admission   GPU prefix hit = g tokens (whole blocks)
                n = num_matched_tokens(req, g)        tokens [g, g+n) the store can give,
                                                      ending on a chunk boundary; 0 = none
                n > 0: blocks for [0, g+n) allocated, start_load(req, table, g, g+n),
                       request WAITING_FOR_KV (skipped by the scheduler, others run)
    later       finished_loads() -> LoadResult(req, k): tokens [g, g+k) are valid KV,
                k <= n, a whole-chunk prefix of the load (0 when it failed); the request
                runs again from g+k and computes the rest. Bytes beyond g+k that the load
                may have written are never read before compute overwrites them.
    each step   on_computed(req, start, end, table): KV of [start, end) was just written;
                the connector may copy out new full chunks (saves); it must not block on
                I/O and must finish reading the blocks before it returns (they may be
                freed right after).
    finish      request_finished(req): forget the request; if its load is in flight, the
                engine keeps its blocks until that load is reported in finished_loads.

Contract of a load: the connector writes only the slots of tokens [token_start,
token_end) in the blocks it was given, and nothing after it has reported the result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.request import Request
from protocol.ids import BlockId, RequestId


@dataclass(frozen=True)
class LoadResult:
    """Outcome of one load: `num_tokens` valid tokens from the load's first token."""

    request_id: RequestId
    num_tokens: int


class KVConnector(ABC):
    """External KV for the engine: lookups and async loads on admission, saves after
    compute. Engine thread only (see the module docstring for the contract)."""

    @abstractmethod
    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after `num_computed_tokens` (the GPU prefix, whole blocks) that the
        external store holds, ending on a chunk boundary and before the request's last
        token (its logits are needed): 0 when none. Never raises; bounded time."""

    @abstractmethod
    def start_load(
        self, request: Request, block_ids: list[BlockId], token_start: int, token_end: int
    ) -> None:
        """Begin filling tokens [token_start, token_end) into the request's blocks
        (`block_ids` is its whole table) asynchronously; the result comes through
        `finished_loads`, exactly once per call, even when it fails."""

    @abstractmethod
    def finished_loads(self) -> list[LoadResult]:
        """Loads completed since the last call (success, partial or failed)."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until a load may have finished or `timeout_s` passed (the engine calls
        it when nothing else can run, instead of spinning)."""

    @abstractmethod
    def on_computed(
        self, request: Request, token_start: int, token_end: int, block_ids: list[BlockId]
    ) -> None:
        """KV of tokens [token_start, token_end) was just computed into `block_ids`."""

    @abstractmethod
    def request_finished(self, request: Request) -> None:
        """The request left the engine (finished or aborted)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most connectors hold nothing)
        """Stop the connector's threads and release what it holds."""


class NoKVConnector(KVConnector):
    """The "off" connector: no external KV, nothing saved."""

    def num_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def start_load(
        self, request: Request, block_ids: list[BlockId], token_start: int, token_end: int
    ) -> None:
        raise AssertionError("NoKVConnector never matches, so nothing is ever loaded")

    def finished_loads(self) -> list[LoadResult]:
        return []

    def wait(self, timeout_s: float) -> None:
        return None

    def on_computed(
        self, request: Request, token_start: int, token_end: int, block_ids: list[BlockId]
    ) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        return None

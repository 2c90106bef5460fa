"""Request: one sequence's state inside an engine, from admission to finish."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from protocol.hashing import hash_chain
from protocol.ids import BlockHash, RequestId
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    """Admitted with blocks, its prefix loading from an external store (KVConnector)."""
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    """Owns one request's tokens and progress.

    The one scheduling model: `num_computed_tokens` (tokens whose KV is in the cache)
    catches up to `num_tokens` (prompt + generated). A step that brings them level produces
    logits for the last token, which are sampled into the next output token. Prefill,
    chunked prefill, decode and recompute after preemption are all this one rule.

    `block_hashes` is the hash chain over all full blocks of prompt + output, extended as
    tokens arrive.
    """

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        block_size: int,
        hash_root: BlockHash,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float | None] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time_s = time.monotonic()
        self.num_preemptions = 0
        self.prefill_only = False
        """Leave the engine after the first sampled token (see LLMEngine.add_request)."""
        # Prompt tokens served from the prefix cache at first admission (None before it).
        self.num_cached_prompt_tokens: int | None = None
        # Prompt tokens loaded from the external store (KVConnector) at first admission.
        self.num_pool_prompt_tokens = 0
        self._block_size = block_size
        self._hash_root = hash_root
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()
        self.generator: torch.Generator | None = None
        self.grammar: GrammarState | None = None
        """Structured output's matcher (set by the engine when params.grammar is set)."""
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int, logprob: float | None) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        done = len(self.block_hashes)
        if (done + 1) * self._block_size > len(self.all_token_ids):
            return
        parent = self.block_hashes[-1] if done else self._hash_root
        start = done * self._block_size
        self.block_hashes.extend(hash_chain(self.all_token_ids[start:], self._block_size, parent))

"""Structured output: grammars (JSON schema, any JSON object, Lark) as token masks.

The grammar engine is llguidance (docs/benchmarks.md "Constrained decoding" has the
measurement that chose it over xgrammar). Three pieces:

    GrammarCompiler   spec -> compiled matcher, on its own thread, cached by spec
    GrammarState      one request's matcher; replays the request's output tokens
    fill_bitmasks     a batch of states -> [N, ceil(V / 32)] int32 bitmask (CPU)
    apply_bitmask     bitmask -> -inf on the logits of disallowed tokens (any device)

A request's grammar state is a pure function of its output tokens: before each mask the
state consumes the output tokens it has not seen yet. So a decode instance that admits a
request after its first token (sampled under the same grammar by the prefill instance)
rebuilds the exact state, and preemption by recompute changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from modelinfo.tokenizer import Tokenizer
from protocol.grammar import grammar_text
from protocol.sampling import GrammarSpec

log = logging.getLogger(__name__)

_CACHE_SIZE = 256
"""Compiled grammars kept (LRU); a tool set or schema reused across requests compiles once."""


class GrammarCompiler:
    """Compiles specs for one tokenizer on a background thread (never the engine's).

    `submit` returns at once with a Future of a template matcher; requests deep-copy it.
    The tokenizer's llguidance view is built on the compile thread too (~0.2 s once).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(self.submit(spec))

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
            )
        # Errors (a bad spec from a caller that did not check it) surface through the
        # Future; the request's state then allows only EOS.
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher. `sync(output_token_ids)` brings it up to date. A grammar
    that did not compile, or a matcher that refused a token, allows only EOS: the request
    ends rather than generating unconstrained text."""

    def __init__(self, template: Future[llguidance.LLMatcher]) -> None:
        self._template = template
        self._matcher: llguidance.LLMatcher | None = None
        self._num_consumed = 0
        self.error: str | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher | None:
        """None when the grammar did not compile (`error` says why)."""
        if self._matcher is None and self.error is None:
            # Compiles take ~1 ms for typical schemas, far less than the prompt's prefill
            # that runs before the first mask; this waits only for pathological grammars.
            try:
                self._matcher = self._template.result().deep_copy()
            except Exception as e:
                self.error = f"grammar did not compile: {e}"
                log.warning("%s", self.error)
        return self._matcher

    def sync(self, output_token_ids: Sequence[int]) -> None:
        matcher = self.matcher
        new = output_token_ids[self._num_consumed :]
        if matcher is not None and new:
            if not matcher.consume_tokens(list(new)):
                self.error = f"grammar refused a generated token: {matcher.get_error()}"
                log.warning("%s", self.error)
            self._num_consumed = len(output_token_ids)


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_bitmasks(
    num_rows: int, rows: Sequence[tuple[int, GrammarState, Sequence[int]]], vocab_size: int
) -> torch.Tensor:
    """[num_rows, ceil(V / 32)] int32 on the CPU: bit t of row i = token t allowed.

    `rows`: (row, state, the row's EOS ids); rows not named allow every token. A state
    without a working matcher allows only its EOS ids. The masks of a batch are computed
    in parallel on llguidance's own threads."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
    pairs = []
    for row, state, eos_ids in rows:
        matcher = state.matcher
        if matcher is not None and state.error is None:
            pairs.append((matcher, row))
            continue
        bitmask[row] = 0
        for t in eos_ids:
            bit = 1 << (t % 32)
            bitmask[row, t // 32] |= bit if bit < 2**31 else -(2**31)
    if pairs:
        _EXECUTOR.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, num_rows)
    return bitmask


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, W] int32 (CPU) -> [N, 32 W] bool on `device`: True = allowed.

    On the CPU numpy unpacks the bits (one C loop; torch's shift-and-mask over [N, V] is
    ~10x slower); on an accelerator the int32 words travel (V / 8 bytes a row) and are
    expanded there by shifts."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits).bool()
    return unpack_bitmask_torch(bitmask.to(device, non_blocking=True))


def unpack_bitmask_torch(mask: torch.Tensor) -> torch.Tensor:
    """unpack_bitmask's device path, with torch ops only (on mask's device)."""
    shifts = _BIT_SHIFTS.get(mask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[mask.device] = torch.arange(32, dtype=torch.int32, device=mask.device)
    return ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[i, t] = -inf where bit t of bitmask[i] is 0; in place, on logits' device.
    Token ids at or above 32 x words (a vocabulary padded past the tokenizer's) are masked."""
    vocab = logits.shape[1]
    allowed = unpack_bitmask(bitmask, logits.device)
    if allowed.shape[1] >= vocab:
        logits.masked_fill_(~allowed[:, :vocab], float("-inf"))
    else:
        logits[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
        logits[:, allowed.shape[1] :] = float("-inf")

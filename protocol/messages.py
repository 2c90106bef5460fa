"""Wire messages between router, prefill and decode instances (msgspec, JSON over HTTP).

The serving path of one request (prefill PP stages x decode TP x DCP ranks: the flows):

    router ── AdmitRequest ─────────▶ decode      reserves landing space (waits if full)
           ◀─ AdmitResponse ────────              one LandingInfo per decode rank
    router ── PrefillRequest ───────▶ prefill     computes, writes KV into the landing
           ◀─ PrefillEvent stream ──              FirstToken at once, then HandoffDone
    router ── DecodeRequest ────────▶ decode      scatters landing -> pages, decodes
           ◀─ DecodeEvent stream ───              TokenBatch ... (finish_reason on last)
    router ── AbortRequest ─────────▶ both        on client disconnect or error

Streams are newline-delimited JSON: one encoded event per line. Version bumps when a
message changes incompatibly; peers reject other versions with a clear error.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.kv_layout import KVLayout
from protocol.sampling import SamplingParams

PROTOCOL_VERSION = 2
"""2: LandingInfo carries the rank's KV heads and DCP stripe, KVSegment its rank and the
layer range of the prefill stage that wrote it (PP prefill x TP x DCP decode)."""


class PromptUsage(msgspec.Struct, frozen=True):
    """Where each prompt token came from, reported by the instance that prefilled.
    gpu + pool + computed == prompt_tokens."""

    prompt_tokens: int
    gpu_tokens: int
    pool_tokens: int
    computed_tokens: int


class LandingInfo(msgspec.Struct, frozen=True):
    """Where one decode rank wants a request's KV written (its registered landing region),
    and which part of the KV the rank holds: KV heads [kv_head_start, + layout.num_kv_heads)
    of the model, tokens t ≡ dcp_rank (mod dcp_size), every layer (layout.num_layers).

    Each prefill stage writes its layers' part of the rank's tokens as segments packed
    [stage layers, 2 (K, V), stripe tokens, num_kv_heads, head_dim] of layout.dtype; where
    they go is the writer's choice (KVSegment.offset_bytes), inside capacity_bytes.
    transfer/flows.py places stage s's segments of tokens [a, b) at
        n_rank * layer_start_s * B  +  stripe_len(0, a) * num_layers_s * B
    (n_rank = the rank's tokens of the prompt, B = layout.bytes_per_token_per_layer).
    """

    rank: int
    transport: str
    """Registered transport name (transfer/): "mooncake" or "local"."""
    peer: str
    """Transport address of the decode rank, e.g. "127.0.0.1:15001"."""
    buffer_addr: int
    """Address of the region's first byte in the decode rank's registered buffer."""
    capacity_bytes: int
    layout: KVLayout
    kv_head_start: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0


class KVSegment(msgspec.Struct, frozen=True):
    """Layers [layer_start, layer_end) (None: all of the rank's layout) of the rank's
    tokens in [token_start, token_end), written at landing offset `offset_bytes` of decode
    rank `rank`. A request's segments of one (rank, layer range) tile its prompt in order."""

    token_start: int
    token_end: int
    offset_bytes: int
    num_bytes: int
    rank: int = 0
    layer_start: int = 0
    layer_end: int | None = None


class AdmitRequest(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    num_prompt_tokens: int
    max_tokens: int


class AdmitResponse(msgspec.Struct, frozen=True):
    request_id: str
    landing: list[LandingInfo]


class PrefillRequest(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    landing: list[LandingInfo]
    """Empty when the request ends at its first token (max_tokens == 1 or a stop)."""


class FirstToken(msgspec.Struct, frozen=True, tag="first_token"):
    request_id: str
    token_id: int
    logprob: float | None
    usage: PromptUsage
    finish_reason: str | None
    """Set when the request is already finished after this token (no decode needed)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """(token id, logprob) alternatives when params.top_logprobs > 0."""


class HandoffDone(msgspec.Struct, frozen=True, tag="handoff_done"):
    request_id: str
    segments: list[KVSegment]
    num_bytes: int
    num_ops: int
    seconds: float


class TokenBatch(msgspec.Struct, frozen=True, tag="tokens"):
    request_id: str
    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    num_output_tokens: int
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Per token, its (token id, logprob) alternatives when params.top_logprobs > 0."""


class ErrorEvent(msgspec.Struct, frozen=True, tag="error"):
    request_id: str
    status: int
    """HTTP status the router should answer with (4xx user error, 5xx server fault)."""
    message: str


PrefillEvent = FirstToken | HandoffDone | ErrorEvent
DecodeEvent = TokenBatch | ErrorEvent


class DecodeRequest(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprob: float | None
    params: SamplingParams
    segments: list[KVSegment]
    first_top_logprobs: list[tuple[int, float]] | None = None


class AbortRequest(msgspec.Struct, frozen=True):
    request_id: str
    reason: Literal["client_disconnected", "error", "timeout", "finished"] = "client_disconnected"
    """"finished": the router has the request's end before this worker (a stop string it
    found first, or a prefill that ended at its first token) and frees what is left."""


class InstanceStatus(msgspec.Struct, frozen=True):
    """GET /status of a worker: what the launcher's `status` and tests read."""

    name: str
    role: str
    healthy: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    landing_bytes_total: int = 0
    landing_bytes_used: int = 0
    queued_tokens: int = 0
    """Prompt tokens admitted but not computed yet."""
    compute_tokens_per_s: float | None = None
    """Measured prompt tokens per busy second (protocol/kv_events.py WorkerLoad)."""
    restore_bytes_per_s: float | None = None
    """Measured pool restore bandwidth; None until a restore ran."""


def encode_line(event: msgspec.Struct) -> bytes:
    """One NDJSON line."""
    return msgspec.json.encode(event) + b"\n"

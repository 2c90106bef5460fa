"""Wire messages between router, prefill and decode instances (msgspec, JSON over HTTP).

The serving path of one request: two worker calls from the router, one direct line from
prefill to decode (prefill PP stages x decode TP x DCP ranks: the flows):

    router ── DecodeRequest ────────▶ decode      reserves pages (inside its engine) and
           ◀─ DecodeReady ──────────              a landing region; then waits in-engine
    router ── PrefillRequest ───────▶ prefill     computes; per prefill chunk every stage
           ◀─ FirstToken ───────────              writes KV into the landing ring
                     prefill ── HandoffNotice ──▶ decode   (POST notify_url, off the
                                                  engine threads): SegmentsLanded (decode
                                                  scatters them into the reserved pages,
                                                  then answers: the ring space is free),
                                                  PrefillFirstToken, FlowClosed
           ◀─ TokenBatch ... ───────  decode      on the stream opened first
    router ── AbortRequest ─────────▶ both        on client disconnect or error

Streams are newline-delimited JSON: one encoded event per line. Version bumps when a
message changes incompatibly; peers reject other versions with a clear error.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.kv_layout import KVLayout
from protocol.sampling import SamplingParams

PROTOCOL_VERSION = 5
"""3: the router opens decode first (DecodeReady carries the landing), prefill tells
decode directly (HandoffNotice), the landing region is a ring the flows stream through.
4: a LandingInfo carries its capability and expiry (protocol/landing_capability.py).
5: the router may send prefill beside decode (PrefillRequest.await_landing) and forward
decode's landing later (LandingGrant, POST /landing)."""


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
    [stage layers, layout.num_parts (K, V; or the MLA latent), stripe tokens, num_kv_heads,
    layout.row_width] of layout.storage_dtype (fp8 rows carry their scales; an MLA layout
    has one head, which every rank holds); where
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
    expires_at_s: float = 0.0
    """Unix time after which prefill no longer accepts this landing."""
    peer_incarnation: str = ""
    """Incarnation of the rank's transport (protocol/incarnation.py): prefill's Mooncake
    transport refreshes what it cached about `peer` when this changes."""
    capability: str = ""
    """HMAC of the request id and every field above, minted by the decode instance that
    reserved the region (protocol/landing_capability.py); prefill writes nothing without
    a valid one."""


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


class DecodeRequest(msgspec.Struct, frozen=True):
    """Router -> decode POST /decode: the request, before prefill runs. Decode answers
    with an NDJSON stream: DecodeReady (pages reserved, landing ring allocated), then
    TokenBatch ... once prefill's KV and first token arrived."""

    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class DecodeReady(msgspec.Struct, frozen=True, tag="ready"):
    """Decode's first line: where prefill writes (one LandingInfo per decode rank) and
    where prefill posts its HandoffNotices."""

    request_id: str
    landing: list[LandingInfo]
    notify_url: str
    incarnation: str = ""
    """The decode worker process's incarnation (protocol/incarnation.py): when this stream
    breaks, the router blames the instance only if it still runs this incarnation."""


class PrefillRequest(msgspec.Struct, frozen=True):
    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    landing: list[LandingInfo]
    """Empty when the request ends at its first token (max_tokens == 1)."""
    notify_url: str = ""
    """Decode's POST endpoint for this request's HandoffNotices (with `landing`)."""
    await_landing: bool = False
    """Decode's landing follows in a LandingGrant (POST /landing): the router sends this
    request beside decode's, not after its DecodeReady, so prefill computes while decode
    reserves. `landing` and `notify_url` are then empty; prefill holds the request's KV
    (and its PrefillFirstToken to decode) until the grant comes."""


class LandingGrant(msgspec.Struct, frozen=True):
    """POST /landing on prefill: decode's DecodeReady for a request sent with
    `await_landing` (the router forwards it as it comes; it may arrive before the
    PrefillRequest itself)."""

    version: int
    request_id: str
    landing: list[LandingInfo]
    notify_url: str


class FirstToken(msgspec.Struct, frozen=True, tag="first_token"):
    request_id: str
    token_id: int
    logprob: float | None
    usage: PromptUsage
    finish_reason: str | None
    """Set when the request is already finished after this token (no decode needed)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """(token id, logprob) alternatives when params.top_logprobs > 0."""


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


PrefillEvent = FirstToken | ErrorEvent
DecodeEvent = DecodeReady | TokenBatch | ErrorEvent


class GenerateRequest(msgspec.Struct, frozen=True):
    """Router -> unified instance POST /generate: the whole request in one call. The
    instance prefills (restoring history from the pool) and decodes it in one engine and
    answers with an NDJSON stream of GenerateEvent: FirstToken (with the prompt's usage),
    then TokenBatch ... until one carries a finish_reason (or an ErrorEvent)."""

    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


GenerateEvent = FirstToken | TokenBatch | ErrorEvent


# -- prefill -> decode, POST DecodeReady.notify_url ----------------------------------------


class SegmentsLanded(msgspec.Struct, frozen=True, tag="landed"):
    """Prefill stage `stage` (of `num_stages`) finished writing these segments into the
    landing ring (every rank's). Decode answers 200 after scattering them into the
    request's pages: their ring bytes may then be written again. 410: the request is
    gone at decode; the stage stops sending."""

    request_id: str
    stage: int
    num_stages: int
    segments: list[KVSegment]


class FlowClosed(msgspec.Struct, frozen=True, tag="closed"):
    """Stage `stage` writes nothing more for this request (done, failed or aborted): after
    every stage closed, decode may reuse the request's landing ring (the fence)."""

    request_id: str
    stage: int
    num_stages: int
    error: str | None = None
    num_bytes: int = 0
    num_ops: int = 0
    seconds: float = 0.0
    """Write time of the stage's flows (the background thread's, not the engine's)."""


class PrefillFirstToken(msgspec.Struct, frozen=True, tag="first_token"):
    """Prefill's first sampled token: decode continues after it."""

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None
    """(token id, logprob) alternatives when params.top_logprobs > 0."""


HandoffNotice = SegmentsLanded | FlowClosed | PrefillFirstToken


class AbortRequest(msgspec.Struct, frozen=True):
    request_id: str
    reason: Literal["client_disconnected", "error", "timeout", "finished"] = "client_disconnected"
    """"finished": the router has the request's end before this worker (a stop string it
    found first, or a prefill that ended at its first token) and frees what is left."""
    prefill_contacted: bool = True
    """Decode: whether a prefill was sent the request. False: no write can be in flight
    into its landing ring, which is reused at once; True: only after every prefill stage
    closed its flow (or the landing quarantine passed)."""


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

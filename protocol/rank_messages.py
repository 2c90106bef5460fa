"""Messages between the processes of ONE instance: the driver (rank / stage 0, which runs
the HTTP service and the scheduler) and the rank or stage processes it spawned.

They travel over torch.distributed as msgpack bytes (engine/parallel/comm.py), never
pickle. Engine-level messages carry a step; the KV connector's step metadata and its
workers' reports (engine/kv_connector.py) ride inside them as opaque bytes that the
connectors encode (pool: protocol/pool_messages.py; handoff:
protocol/handoff_messages.py):

    decode TP x DCP (rank 0 ── broadcast ──▶ every rank, in order)
        RankStep      one engine step (possibly empty: a connector poll): every rank runs
                      its connector worker and its shard of the forward; with
                      want_reports each rank >= 1 then sends its report to rank 0
        RankCommand   a worker command run on every rank, then acked
        Shutdown

    prefill PP (ring: stage 0 ─▶ 1 ─▶ ... ─▶ N-1 ─▶ 0)
        StageStep     the step's batch (possibly empty: a connector poll), sampling rows,
                      connector metadata; each stage appends its connector report, and
                      the hidden states follow it (when the batch has tokens)
        StageResult   from the last stage: sampled tokens and every stage's report
"""

from __future__ import annotations

import msgspec

from protocol.sampling import SamplingParams


class StepBatch(msgspec.Struct, frozen=True, array_like=True):
    """One engine step's flat batch (engine/model_runner.py): sequence b has query rows
    query_start_loc[b]:query_start_loc[b+1] and seq_lens[b] tokens after the step."""

    input_ids: list[int]
    """Empty where the receiver does not embed (pipeline stages after the first)."""
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    """Scheduler block ids of each sequence (the same ids on every rank and stage)."""


class SampleRow(msgspec.Struct, frozen=True, array_like=True):
    """A row of the step's logits to sample, with what the sampler needs of its request."""

    row: int
    params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...] = ()
    """Only when params.repetition_penalty != 1 (the penalty reads the prompt)."""
    output_token_ids: tuple[int, ...] = ()
    """Only when penalties or a grammar read them (len == num_output_tokens then)."""


class RankStep(msgspec.Struct, frozen=True, tag="rank_step"):
    batch: StepBatch
    kv_meta: bytes = b""
    """The KV connector's metadata of the step (b"" for none)."""
    want_reports: bool = False
    """Every rank >= 1 sends its connector report to rank 0 after the step."""
    load: bool = True
    """False: the connector's loads of kv_meta were started by an earlier run of this
    step (one whose forward failed; engine/step_isolation.py)."""
    probe: bool = False
    """A bisection run of part of a failed step: the forward only (no loads, saves or
    reports); its outputs are discarded."""
    fault: str = ""
    """Test-only injected forward fault (engine/faults.py): every rank raises it before
    its forward, as a request's input makes every rank fail alike, or only
    `fault_rank`, before layer `fault_layer`."""
    fault_rank: int = -1
    fault_layer: int = 0


class RankCommand(msgspec.Struct, frozen=True, tag="rank_command"):
    payload: bytes


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


RankMessage = RankStep | RankCommand | Shutdown


class StageStep(msgspec.Struct, frozen=True, tag="stage_step"):
    step_id: int
    batch: StepBatch
    samples: list[SampleRow]
    kv_meta: bytes
    """The KV connector's metadata of the step, for every stage's worker (b"" for none)."""
    reports: list[bytes]
    """Connector reports of the stages the step went through so far, in stage order."""
    request_ids: list[str] = []
    """The request of each sequence of the batch (stages remember forward culprits by
    id: a culprit's later chunks may already be on the ring)."""
    culprits: list[tuple[int, str]] = []
    """(sequence, error) whose forward failed on a stage the step went through: later
    stages skip them (their hidden states are not valid) and drop their saves and sends
    (engine/parallel/pp_isolation.py)."""
    poisoned: list[int] = []
    """Test-only: sequences whose request carries the injected forward fault's seed
    (engine/faults.py)."""


StageMessage = StageStep | Shutdown


class StageResult(msgspec.Struct, frozen=True, tag="stage_result"):
    step_id: int
    token_ids: list[int]
    logprobs: list[float | None]
    reports: list[bytes]
    """Connector reports, one per stage, stage order."""
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Per sampled row, (token id, logprob) alternatives when its params ask for them."""
    failed: list[tuple[int, str]] = []
    """(sampled row, error) of rows that could not be sampled: those requests fail
    alone (engine/step_isolation.py); their token_ids entry is meaningless."""
    culprits: list[tuple[str, str]] = []
    """(request id, error) of requests whose forward failed on some stage in this step:
    they fail alone; their sampled token, if any, is meaningless."""


# -- worker-level payloads ------------------------------------------------------------------


class RankLanding(msgspec.Struct, frozen=True, array_like=True):
    """A decode rank's registered landing buffer, reported to rank 0 at start."""

    rank: int
    transport: str
    peer: str
    base_addr: int
    nbytes: int


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)

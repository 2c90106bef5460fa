"""PipelinedEngine's scheduling over an in-process stand-in pipeline (results come back
`depth` steps late, in order): same tokens as LLMEngine, steps really in flight, requests
paused while their token is out, aborts in flight, connector metadata and reports in
order."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_connector import ConnectorUpdate, NoConnectorScheduler, NoConnectorWorker, StepKV
from engine.llm_engine import LLMEngine
from engine.parallel.pp_engine import PipelinedEngine
from engine.parallel.step_inputs import batch_tensors
from engine.sampler import Sampler, SamplingState
from modelinfo.info import load_model_info
from protocol.rank_messages import SampleRow, StageResult, StepBatch
from protocol.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class InProcessPipeline:
    """Stands in for PipelineExecutor: runs the whole model at submit (so KV is written in
    step order, as on every real stage) and returns results only at collect."""

    def __init__(self, engine: LLMEngine, depth: int) -> None:
        self.model = engine.runner.model  # type: ignore[attr-defined]
        self.kv_caches = engine.runner.kv_caches
        self.num_blocks = engine.runner.num_blocks
        self.layer_split = (2, 2)
        self.depth = depth
        self.block_size = engine.config.block_size
        self._results: deque[StageResult] = deque()
        self._ids = 0
        self.max_outstanding = 0
        self.sampler = Sampler()

    def execute(self, scheduled, kv):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def set_kv_worker(self, worker) -> None:  # type: ignore[no-untyped-def]
        self.kv_worker = worker

    def submit(
        self,
        batch: StepBatch,
        samples: list[SampleRow],
        kv_meta: bytes,
        request_ids: list[str] | None = None,
        poisoned: list[int] | None = None,
    ) -> int:
        tokens: list[int] = []
        logprobs: list[float | None] = []
        step = self._ids
        self._ids += 1
        if not batch.positions:  # a connector poll
            self._results.append(StageResult(step, [], [], [kv_meta, kv_meta]))
            return step
        ids, positions, meta = batch_tensors(batch, torch.device("cpu"), self.block_size)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        logprobs: list[float | None] = []
        if samples:
            rows = torch.tensor([s.row for s in samples])
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            states = [
                SamplingState(s.params, s.num_output_tokens, None, s.eos_token_ids) for s in samples
            ]
            result = self.sampler.sample(logits, states)
            tokens, logprobs = list(result.token_ids), list(result.logprobs)
        self._results.append(StageResult(step, tokens, logprobs, [kv_meta, kv_meta]))
        self.max_outstanding = max(self.max_outstanding, len(self._results))
        return step

    def collect(self) -> StageResult:
        return self._results.popleft()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 50, 90, 17)]


def _engines(model_dir: Path, cache_dir: str, depth: int):  # type: ignore[no-untyped-def]
    config = EngineConfig(
        cache_dir=cache_dir, block_size=4, num_blocks=200, max_num_batched_tokens=24
    )
    inner = LLMEngine.from_spec(str(model_dir), config)
    pipe = InProcessPipeline(inner, depth)
    return PipelinedEngine(load_model_info(str(model_dir)), config, pipe), pipe, config


@pytest.mark.parametrize("depth", [2, 4])
def test_same_tokens_with_steps_in_flight(tiny_parallel_dir, weights_cache_dir, prompts, depth):
    engine, pipe, config = _engines(tiny_parallel_dir, weights_cache_dir, depth)
    reference = LLMEngine.from_spec(str(tiny_parallel_dir), config)
    want = [c.token_ids for c in reference.generate(prompts, PARAMS)]
    got = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    assert got == want
    assert pipe.max_outstanding == depth  # chunks of the long prompts filled the pipeline
    assert not engine.scheduler.paused and engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.namespace.layer_split == (2, 2)


class RecordingConnector(NoConnectorScheduler):
    """Step metadata = the KV ranges the step computes; the stand-in pipeline echoes it
    back as each stage's report."""

    def __init__(self) -> None:
        self.reports: list[list[bytes]] = []

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        return b";".join(
            f"{kv.request.request_id}:{kv.token_start}-{kv.token_end}".encode() for kv in computed
        )

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        if any(reports):
            self.reports.append(list(reports))
        return ConnectorUpdate()


def test_abort_in_flight_and_meta_in_order(tiny_parallel_dir, weights_cache_dir, prompts):
    engine, _, config = _engines(tiny_parallel_dir, weights_cache_dir, 2)
    conn = RecordingConnector()
    engine.set_kv_connector(conn, NoConnectorWorker())
    reports = conn.reports
    keep = engine.add_request(prompts[1], PARAMS, "keep")
    gone = engine.add_request(prompts[2], PARAMS, "gone")
    engine.step()  # first chunk of both in flight, nothing back yet
    assert engine.abort(gone)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {keep}
    reference = LLMEngine.from_spec(str(tiny_parallel_dir), config)
    assert [t for o in outputs for t in o.new_token_ids] == reference.generate(
        [prompts[1]], PARAMS
    )[0].token_ids
    # Reports came back step by step, each stage's report of that step's metadata.
    assert reports[0][0].startswith(b"keep:0-") and reports[0][0] == reports[0][1]
    assert all(len(r) == 2 for r in reports)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_steps_on_the_ring_keep_the_engine_busy(tiny_parallel_dir, weights_cache_dir, prompts):
    engine, pipe, _ = _engines(tiny_parallel_dir, weights_cache_dir, 2)
    rid = engine.add_request(prompts[1], PARAMS, "gone")
    engine.step()  # its first chunk is on the ring
    assert engine.abort(rid) and not engine.scheduler.has_work()
    assert engine.has_unfinished()  # the step in flight must still be collected
    while engine.has_unfinished():
        assert engine.step() == []  # the aborted request's token is dropped
    assert not pipe._results  # every step collected, in order

"""Parallel engines (engine/parallel/) against the single-process engine and transformers,
each rank a real process over gloo: prefill pipelines and decode TP x DCP must give
token-identical greedy output, also with a KV connector whose worker side runs on every
stage and rank (its metadata reaches each of them with the step, their reports come back
with it in rank order, idle steps poll them, held blocks are freed when released)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
import torch

from engine.config import EngineConfig
from engine.kv_connector import (
    ConnectorUpdate,
    KVConnectorWorker,
    NoConnectorScheduler,
    StepKV,
    WorkerPlace,
)
from engine.llm_engine import LLMEngine
from engine.parallel.launch import generate_parallel
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [5, 37, 70, 16]
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_parallel_dir: Path, prompts, weights_cache_dir: str) -> list[list[int]]:
    engine = LLMEngine.from_spec(str(tiny_parallel_dir), EngineConfig(cache_dir=weights_cache_dir))
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_parallel_dir), torch_dtype=torch.float32)
    for p, w in zip(prompts, want, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out[0, len(p) :].tolist() == w, "single-process engine differs from transformers"
    return want


class EchoWorker(KVConnectorWorker):
    """Reports `<its rank or stage>|<the step's metadata>` after every step."""

    def __init__(self) -> None:
        self.seen = b""
        self.name = b"?"

    def register_kv_caches(self, kv_caches, place: WorkerPlace) -> None:
        rank = place.stage if place.shard is None else place.shard.rank
        self.name = str(rank).encode()

    def start_loads(self, meta: bytes) -> None:
        self.seen = meta

    def start_saves(self, meta: bytes) -> None:
        assert meta == self.seen, "start_saves got other metadata than start_loads"

    def get_finished(self) -> bytes:
        return self.name + b"|" + self.seen


class CheckingScheduler(NoConnectorScheduler):
    """Names every step with work in its metadata and checks that each worker echoes it,
    with that step's result, in rank order; holds every finished request's blocks for two
    more report rounds (so the engine must poll its idle workers to free them)."""

    WORLD = 2

    def __init__(self) -> None:
        self.n = 0
        self.sent: deque[bytes] = deque()
        self.held: dict[str, int] = {}

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        if not computed:
            return b""
        self.n += 1
        meta = f"step{self.n}".encode()
        self.sent.append(meta)
        return meta

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        parts = [r.split(b"|", 1) for r in reports]
        assert [p[0] for p in parts] == [str(i).encode() for i in range(self.WORLD)], reports
        echoed = {p[1] for p in parts}
        assert len(echoed) == 1, f"workers saw different metadata: {reports}"
        meta = echoed.pop()
        if meta:
            assert meta == self.sent.popleft(), (meta, list(self.sent))
        out = ConnectorUpdate()
        for rid in list(self.held):
            self.held[rid] -= 1
            if self.held[rid] == 0:
                del self.held[rid]
                out.released.add(rid)  # type: ignore[arg-type]
        return out

    def request_finished(self, request, block_ids) -> bool:
        if not block_ids:
            return False
        self.held[request.request_id] = 2
        return True

    def has_pending(self) -> bool:
        return bool(self.held)


def checking_connector(rank: int):  # type: ignore[no-untyped-def]
    return (CheckingScheduler() if rank == 0 else None), EchoWorker()


RUN_ENV = "KVSERVE_TEST_RUN_ENV"
"""Set by a test after the ranks' forkserver may already run: every rank must see it."""


def env_checking_connector(rank: int):  # type: ignore[no-untyped-def]
    assert os.environ.get(RUN_ENV) == "set by the test", f"rank {rank} lacks the caller's env"
    assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"
    return checking_connector(rank)


@pytest.mark.parametrize("layout", ["pp2", "tp2dcp2"])
def test_connector_runs_on_every_rank_and_stage(
    tiny_parallel_dir, prompts, reference, weights_cache_dir, layout, monkeypatch
):
    """...and every rank runs in the caller's environment of this call (the ranks'
    forkserver started earlier, with an older one)."""
    monkeypatch.setenv(RUN_ENV, "set by the test")
    kw = {"pp": 2} if layout == "pp2" else {"tp": 2, "dcp": 2}
    got = generate_parallel(
        str(tiny_parallel_dir),
        _config(weights_cache_dir),
        prompts,
        PARAMS,
        connector=env_checking_connector,
        **kw,  # type: ignore[arg-type]
    )
    assert got == reference  # and every block was freed after the held ones were released


def _config(cache_dir: str, **kw) -> EngineConfig:
    base = dict(cache_dir=cache_dir, block_size=4, num_blocks=256, max_num_batched_tokens=32)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tp", "dcp"), [(2, 2), (2, 1)])
def test_decode_tp_dcp_matches_single_process(
    tiny_parallel_dir, prompts, reference, weights_cache_dir, tp, dcp
):
    got = generate_parallel(
        str(tiny_parallel_dir), _config(weights_cache_dir), prompts, PARAMS, tp=tp, dcp=dcp
    )
    assert got == reference


@pytest.mark.parametrize(
    ("tp", "dcp", "connector", "rank", "layer"),
    [
        (2, 1, False, None, 0),
        (2, 2, True, None, 0),
        (2, 1, False, 1, 1),
        (2, 2, True, 1, 2),
        (2, 2, True, 0, 3),
    ],
)
def test_decode_tp_forward_failure_fails_its_request_alone(
    tiny_parallel_dir, prompts, reference, weights_cache_dir, tp, dcp, connector, rank, layer
):
    """Every rank's forward fails while a poisoned request is in the step (as its input
    would make every rank fail), or only `rank`'s, inside its forward before `layer`
    (the others are then in the layer's collectives: the failing rank completes them
    with zeros and the ranks agree the step failed): the ranks bisect in lockstep, the
    poisoned request ends without tokens, the others are exact; with a connector, every
    rank still gets each step's metadata once and reports it in order, and every block
    is freed."""
    from engine.faults import EngineFaults

    faults = EngineFaults(fail_seed=999, place="forward", rank=rank, layer=layer)
    config = _config(weights_cache_dir, faults=faults)
    params = [PARAMS] * len(prompts)
    params[1] = msgspec.structs.replace(PARAMS, seed=999)
    got = generate_parallel(
        str(tiny_parallel_dir),
        config,
        prompts,
        params,
        tp=tp,
        dcp=dcp,
        connector=checking_connector if connector else None,
    )
    assert got[1] == []
    assert [g for i, g in enumerate(got) if i != 1] == [
        w for i, w in enumerate(reference) if i != 1
    ]


class SaveRecordingWorker(KVConnectorWorker):
    """Its step metadata is the list of requests the step computes; it "saves" each one
    given to start_saves and reports `<stage>|<ids saved>`."""

    def __init__(self) -> None:
        self.stage = -1
        self.saved: list[str] = []

    def register_kv_caches(self, kv_caches, place: WorkerPlace) -> None:
        self.stage = place.stage

    def start_loads(self, meta: bytes) -> None:
        return None

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        ids = msgspec.msgpack.decode(meta) if meta else []
        return msgspec.msgpack.encode([r for r in ids if r not in request_ids])

    def start_saves(self, meta: bytes) -> None:
        self.saved = msgspec.msgpack.decode(meta) if meta else []

    def get_finished(self) -> bytes:
        return f"{self.stage}|{','.join(self.saved)}".encode()


class CulpritCheckingScheduler(NoConnectorScheduler):
    """Checks that no stage from FAULT_STAGE on saves the poisoned request, that the
    stages before it did, and that the scheduler side was told to drop its saves."""

    POISONED = "req-1"
    DEPENDENT: str | None = None
    """A request that shares the culprit's prefix (when the test has one): never saved
    from the failing stage on either."""
    FAULT_STAGE = 0

    def __init__(self) -> None:
        self.dropped: set[str] = set()
        self.saved_by: dict[int, set[str]] = {}

    def build_step_meta(self, computed: Sequence[StepKV]) -> bytes:
        if not computed:
            return b""
        return msgspec.msgpack.encode([str(kv.request.request_id) for kv in computed])

    def without_requests(self, meta: bytes, request_ids: set[str]) -> bytes:
        self.dropped |= request_ids
        return meta

    def update_from_workers(self, reports: Sequence[bytes]) -> ConnectorUpdate:
        for r in reports:
            stage, ids = r.decode().split("|", 1)
            saved = set(ids.split(",")) - {""}
            self.saved_by.setdefault(int(stage), set()).update(saved)
            if int(stage) >= self.FAULT_STAGE:
                assert self.POISONED not in saved, f"stage {stage} saved the culprit"
                assert self.DEPENDENT not in saved, f"stage {stage} saved its dependent"
        if self.POISONED in self.dropped:  # these are the reports of the step that failed
            for stage in range(self.FAULT_STAGE):
                assert self.POISONED in self.saved_by.get(stage, set()), f"stage {stage}"
        return ConnectorUpdate()

    def request_finished(self, request, block_ids) -> bool:
        if request.request_id == self.POISONED:
            assert self.POISONED in self.dropped, "the culprit's saves were still expected"
        return False


class CulpritCheckingStage1(CulpritCheckingScheduler):
    FAULT_STAGE = 1


class SharerCheckingStage1(CulpritCheckingStage1):
    DEPENDENT = "req-2"


def sharer_connector_stage1(rank: int):  # type: ignore[no-untyped-def]
    return (SharerCheckingStage1() if rank == 0 else None), SaveRecordingWorker()


def culprit_connector_stage0(rank: int):  # type: ignore[no-untyped-def]
    return (CulpritCheckingScheduler() if rank == 0 else None), SaveRecordingWorker()


def culprit_connector_stage1(rank: int):  # type: ignore[no-untyped-def]
    return (CulpritCheckingStage1() if rank == 0 else None), SaveRecordingWorker()


@pytest.mark.parametrize("stage", [None, 0, 1])
def test_prefill_pipeline_forward_failure_fails_its_request_alone(
    tiny_parallel_dir, prompts, reference, weights_cache_dir, stage
):
    """A stage's forward fails while a poisoned request is in the step: that stage
    bisects alone, the stages after it skip the culprit (also in its later chunks
    already on the ring), no stage from the failing one on saves it (the connector's
    scheduler side stops expecting it; the stages before saved valid KV), the culprit
    ends without tokens, the others are exact, and every block is freed."""
    from engine.faults import EngineFaults

    faults = EngineFaults(fail_seed=999, place="forward", stage=stage)
    params = [PARAMS] * len(prompts)
    params[1] = msgspec.structs.replace(PARAMS, seed=999)  # 37 tokens: two chunks of 32
    got = generate_parallel(
        str(tiny_parallel_dir),
        _config(weights_cache_dir, faults=faults),
        prompts,
        params,
        pp=2,
        layer_split=(3, 1),
        connector=culprit_connector_stage1 if stage == 1 else culprit_connector_stage0,
    )
    assert got[1] == []
    assert [g for i, g in enumerate(got) if i != 1] == [
        w for i, w in enumerate(reference) if i != 1
    ]


def test_prefill_pipeline_forward_failure_fails_a_request_that_hit_its_blocks(
    tiny_parallel_dir, prompts, reference, weights_cache_dir
):
    """The poisoned request's first chunk is on the ring when another request takes a
    prefix hit on the blocks it is computing (they are cached when the step is issued):
    once stage 1 fails the chunk, that request fails too (its KV on stage 1 would not be
    valid; stage 1 skips it and saves nothing of it), the unrelated one is exact."""
    from engine.faults import EngineFaults

    g = torch.Generator().manual_seed(11)
    poisoned = torch.randint(3, 49152, (40,), generator=g).tolist()
    sharer = poisoned[:36] + torch.randint(3, 49152, (8,), generator=g).tolist()
    params = [PARAMS, msgspec.structs.replace(PARAMS, seed=999), PARAMS]
    got = generate_parallel(
        str(tiny_parallel_dir),
        _config(weights_cache_dir, faults=EngineFaults(fail_seed=999, place="forward", stage=1)),
        [prompts[0], poisoned, sharer],
        params,
        pp=2,
        layer_split=(3, 1),
        connector=sharer_connector_stage1,
    )
    assert got == [reference[0], [], []]


def test_prefill_pipeline_matches_single_process(
    tiny_parallel_dir, prompts, reference, weights_cache_dir
):
    # A 32-token budget splits the longer prompts into chunks that fill the pipeline.
    got = generate_parallel(
        str(tiny_parallel_dir),
        _config(weights_cache_dir),
        prompts,
        PARAMS,
        pp=2,
        layer_split=(3, 1),
    )
    assert got == reference


def test_kv_heads_replicated_when_ranks_outnumber_them(
    tmp_path_factory, tiny_tokenizer_dir, weights_cache_dir
):
    # One KV head, TP 2: each rank holds a copy of it and half of the query heads (vLLM's
    # replication of KV heads).
    from conftest import make_tiny_model

    model = make_tiny_model(
        tmp_path_factory.mktemp("tiny-mqa"),
        tiny_tokenizer_dir,
        "llama",
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 41)]
    engine = LLMEngine.from_spec(str(model), EngineConfig(cache_dir=weights_cache_dir))
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]
    got = generate_parallel(str(model), _config(weights_cache_dir), prompts, PARAMS, tp=2)
    assert got == want


@pytest.fixture(scope="module")
def fp8_reference(tiny_parallel_dir: Path, prompts, weights_cache_dir: str) -> list[list[int]]:
    """The single-process engine with an fp8_e4m3 KV cache (the 4-token blocks of
    _config: rows are quantized one by one, so the block size does not change them)."""
    config = EngineConfig(cache_dir=weights_cache_dir, kv_cache_dtype="fp8_e4m3")
    engine = LLMEngine.from_spec(str(tiny_parallel_dir), config)
    return [c.token_ids for c in engine.generate(prompts, PARAMS)]


@pytest.mark.parametrize(("tp", "dcp", "pp"), [(2, 2, 1), (1, 1, 2)], ids=["tp2-dcp2", "pp2"])
def test_fp8_kv_layouts_match_single_process_fp8(
    tiny_parallel_dir, prompts, fp8_reference, weights_cache_dir, tp, dcp, pp
):
    """TP x DCP (each rank quantizes its heads of its token stripe; the LSE merge runs
    over dequantized values) and a 2-stage pipeline give the tokens of one process."""
    config = _config(weights_cache_dir, kv_cache_dtype="fp8_e4m3")
    split = (3, 1) if pp == 2 else None
    got = generate_parallel(
        str(tiny_parallel_dir), config, prompts, PARAMS, tp=tp, dcp=dcp, pp=pp, layer_split=split
    )
    assert got == fp8_reference

"""The handoff path in one process with the real pieces: a prefill engine whose KV
connector sends each step's prompt KV from its sender threads through a Mooncake tcp
transport into a decode landing ring; a decode engine whose receiver connector keeps the
request waiting inside the engine, scatters every landed piece into the pages it reserved
and starts it once prefill's first token is in. The KV decode holds must be
byte-identical to prefill's, every write ceil(bytes / 8 MiB) ops, and decoding must
continue exactly as the single-process engine, in float32 and in bfloat16, and with an
fp8_e4m3 KV cache (rows with their scales: the decode cache holds prefill's bytes, scales
included)."""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import pytest
import torch

from decode_worker.receiver import HandoffReceiver, LandingWorker
from engine.config import EngineConfig
from engine.kv_connector import NoConnectorScheduler, NoConnectorWorker
from engine.llm_engine import LLMEngine
from prefill_worker.handoff import HandoffScheduler, HandoffWorker
from protocol.handoff_messages import FlowResult
from protocol.messages import FlowClosed, HandoffNotice, SegmentsLanded
from protocol.sampling import SamplingParams
from transfer import MAX_OP_BYTES, LandingArena, TransportConfig, create_transport

MODEL = "builtin:smollm2-135m-instruct"


@pytest.fixture(
    scope="module",
    params=[
        ("float32", "auto"),
        ("bfloat16", "auto"),
        pytest.param(("float32", "fp8_e4m3"), marks=pytest.mark.slow),  # docs/testing.md
    ],
    ids=["float32", "bfloat16", "fp8_e4m3"],
)
def engines(request: pytest.FixtureRequest, weights_cache_dir: str):
    """float32 (the exactness reference), bfloat16 (the fast CPU dtype) and an fp8 KV
    cache: the handoff moves bytes, so each must land byte-identical."""
    dtype, kv = request.param
    kw = {
        "cache_dir": weights_cache_dir,
        "kv_cache_bytes": 128 * 1024**2,
        "dtype": dtype,
        "kv_cache_dtype": kv,
    }
    prefill = LLMEngine.from_spec(MODEL, EngineConfig(max_num_batched_tokens=256, **kw))
    decode = LLMEngine.from_spec(MODEL, EngineConfig(**kw))
    want = torch.uint8 if kv == "fp8_e4m3" else getattr(torch, dtype)
    assert decode.runner.kv_caches[0].dtype == want
    return prefill, decode


def _tokens(caches: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """[L, 2, n, H, D]: the KV of the first n tokens, read straight from the pages."""
    bs = caches[0].shape[2]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    return torch.stack([c.flatten(1, 2)[:, slots] for c in caches])


class Recording(HandoffScheduler):
    """Records the block table prefill computes the prompt into."""

    def __init__(self, num_stages: int) -> None:
        super().__init__(num_stages)
        self.table: list[int] = []

    def build_step_meta(self, computed):  # type: ignore[no-untyped-def]
        for kv in computed:
            self.table = list(kv.block_ids)
        return super().build_step_meta(computed)


def test_decode_receives_exactly_what_prefill_computed(engines, monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    prefill, decode = engines
    send_t = create_transport(TransportConfig(name="mooncake", host="127.0.0.1"))
    land_t = create_transport(TransportConfig(name="mooncake", host="127.0.0.1"))
    # 16 MiB of landing: an 8 MiB region, a quarter of the prompt's 32 MB: the ring turns
    arena = LandingArena(32 * 1024**2, land_t, max_region_bytes=8 * 1024**2)
    receiver = HandoffReceiver(arena, 1, decode.layout)
    decode_worker = LandingWorker(arena, decode.layout, 0, receiver)
    decode.set_kv_connector(receiver, decode_worker)

    landed: list[SegmentsLanded] = []
    closed: list[FlowClosed] = []

    def notify(url: str, notice: HandoffNotice) -> bool:  # prefill's notifier thread
        if isinstance(notice, FlowClosed):
            closed.append(notice)
            receiver.closed(notice)
            return True
        assert isinstance(notice, SegmentsLanded)
        landed.append(notice)
        answer: Future[bool] = receiver.landed(notice)
        return answer.result(timeout=60)  # the main thread's decode steps scatter it

    handoffs = Recording(1)
    results: list[FlowResult] = []
    handoffs.on_closed = lambda _rid, stages: results.extend(stages)
    sender = HandoffWorker(send_t, 16 * 1024**2, notify)
    prefill.set_kv_connector(handoffs, sender)
    try:
        ids = prefill.info.tokenizer.encode("The history of the agent session: " * 120)[:700]
        assert len(ids) == 700
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        nbytes = len(ids) * prefill.layout.bytes_per_token
        region = arena.allocate("r1", nbytes, timeout_s=1)
        assert region is not None and region.nbytes < nbytes

        ready = threading.Event()
        receiver.expect("r1", region, len(ids), ready.set)
        decode.add_request(ids, params, "r1")
        decode.step()  # admitted: pages reserved, waiting for the KV inside the engine
        assert ready.is_set() and len(decode.scheduler.loading) == 1
        pages = list(decode.kv.block_table("r1"))
        assert len(pages) * decode.config.block_size >= len(ids)

        handoffs.add("r1", [arena.landing_info(region, 0, decode.layout)], len(ids), "decode")
        prefill.add_request(ids, params, "r1", prefill_only=True)
        first = None
        held = None
        tokens: list[int] = []
        for _ in range(20000):
            for out in prefill.step() if prefill.has_unfinished() else []:
                first = out
                # the blocks are still held by the handoff (or free, never reused here)
                held = _tokens(prefill.runner.kv_caches, handoffs.table, len(ids))
                assert decode.append_remote_token("r1", out.new_token_ids[0], out.new_logprobs[0])
                assert receiver.first_token("r1")
                tokens.append(out.new_token_ids[0])
            for out in decode.step():
                tokens += out.new_token_ids
                if out.finished:
                    break
            else:
                continue
            break
        assert first is not None and first.prefill_done
        assert held is not None
        assert len(tokens) == 24

        # streamed per prefill chunk (256-token budget), every piece fitting half the ring
        assert [s.segments[0].token_end for s in landed][-1] == 700
        assert all(seg.num_bytes <= region.nbytes // 2 for s in landed for seg in s.segments)
        assert closed and closed[0].error is None
        assert len(results) == 1 and results[0].error is None
        assert results[0].num_bytes == nbytes
        assert results[0].num_ops == sum(
            math.ceil(seg.num_bytes / MAX_OP_BYTES) for s in landed for seg in s.segments
        )
        got = _tokens(decode.runner.kv_caches, pages, len(ids))
        assert torch.equal(got, held)  # byte-identical KV
        # fp8 rows: values and scales in one uint8 row, compared above byte for byte
        assert (got.dtype == torch.uint8) == (prefill.config.kv_cache_dtype == "fp8_e4m3")
        assert arena.used_bytes == 0  # every piece landed: the region is free again

        prefill.set_kv_connector(NoConnectorScheduler(), NoConnectorWorker())
        alone = prefill.generate([ids], params)[0].token_ids
        assert tokens == alone
    finally:
        sender.close()

"""The handoff path in one process with the real pieces: a prefill engine streams its
prompt KV per chunk through a Mooncake tcp transport into a decode landing region, decode
scatters it into its own pages. The KV decode holds must be byte-identical to prefill's,
every write must take ceil(bytes / 8 MiB) ops, and decoding must continue exactly."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from prefill_worker.handoff import HandoffTable, StageSender
from protocol.rank_messages import HandoffCommand
from protocol.sampling import SamplingParams
from transfer import MAX_OP_BYTES, HandoffSender, LandingArena, TransportConfig, create_transport
from transfer.landing import scatter_segments

MODEL = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engines(weights_cache_dir: str):
    prefill = LLMEngine.from_spec(
        MODEL,
        EngineConfig(
            cache_dir=weights_cache_dir, max_num_batched_tokens=256, kv_cache_bytes=128 * 1024**2
        ),
    )
    decode = LLMEngine.from_spec(
        MODEL, EngineConfig(cache_dir=weights_cache_dir, kv_cache_bytes=128 * 1024**2)
    )
    return prefill, decode


def _tokens(ids: list[int], caches: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """[L, 2, n, H, D]: the KV of the first n tokens, read straight from the pages."""
    bs = caches[0].shape[2]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    return torch.stack([c.flatten(1, 2)[:, slots] for c in caches])


def test_decode_receives_exactly_what_prefill_computed(engines, monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    prefill, decode = engines
    send_t = create_transport(TransportConfig(name="mooncake", host="127.0.0.1"))
    land_t = create_transport(TransportConfig(name="mooncake", host="127.0.0.1"))
    assert send_t.peer_address.startswith("127.0.0.1:")
    sender = HandoffSender(send_t, 64 * 1024**2)
    arena = LandingArena(256 * 1024**2, land_t)
    table = HandoffTable()

    ids = prefill.info.tokenizer.encode("The history of the agent session: " * 120)[:700]
    assert len(ids) == 700
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    nbytes = len(ids) * prefill.layout.bytes_per_token
    region = arena.allocate("r1", nbytes, timeout_s=1)
    assert region is not None
    table.add("r1", [arena.landing_info(region, 0, decode.layout)], len(ids))

    held: dict[str, torch.Tensor] = {}

    class Snapshot(StageSender):
        """Sends, then keeps the prompt's KV as prefill holds it (before it is freed)."""

        def start_saves(self, meta: bytes) -> None:
            super().start_saves(meta)
            for cmd in msgspec.msgpack.decode(meta, type=list[HandoffCommand]) if meta else []:
                if cmd.token_end == len(ids):
                    held["prefill"] = _tokens(ids, self.kv_caches, cmd.block_table, len(ids))

    prefill.set_kv_connector(table, Snapshot(sender))
    prefill.add_request(ids, params, "r1", prefill_only=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    first = outs[-1]
    assert first.prefill_done and first.finish_reason is None
    handoff = table.pop("r1")
    assert handoff is not None and handoff.error is None

    # Streamed per prefill chunk (256-token budget): 700 tokens -> 3 segments, in order.
    assert [(s.token_start, s.token_end) for s in handoff.segments] == [
        (0, 256),
        (256, 512),
        (512, 700),
    ]
    per_token = prefill.layout.bytes_per_token
    expected_ops = sum(
        math.ceil((s.token_end - s.token_start) * per_token / MAX_OP_BYTES)
        for s in handoff.segments
    )
    assert handoff.num_ops == expected_ops
    assert handoff.num_bytes == nbytes

    got: dict[str, torch.Tensor] = {}

    def fill(caches, blocks):
        scatter_segments(region, handoff.segments, decode.layout, caches, list(blocks))
        got["decode"] = _tokens(ids, caches, list(blocks), len(ids))

    out = decode.admit_prefilled(
        ids, first.new_token_ids[0], first.new_logprobs[0], params, "r1", fill
    )
    assert out is not None and not out.finished
    arena.free("r1")
    assert torch.equal(got["decode"], held["prefill"])  # byte-identical KV

    tokens = [first.new_token_ids[0]]
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    alone = prefill.generate([ids], params)[0].token_ids
    assert tokens == alone

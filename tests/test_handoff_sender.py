"""The asynchronous handoff sender with the real pieces in one process: a paged KV cache,
the "local" transport into a registered landing arena, and a decode stand-in that
scatters every landed piece into its own pages before answering (as decode_worker does).
Landing regions smaller than the prompt force the ring to be reused."""

from __future__ import annotations

import hashlib
import math
import threading
import time

import pytest
import torch

from protocol.kv_layout import KVLayout
from protocol.messages import FlowClosed, HandoffNotice, LandingInfo, SegmentsLanded
from transfer import (
    MAX_OP_BYTES,
    FlowCoverage,
    HandoffFaults,
    HandoffSender,
    KVShard,
    LandingArena,
    LocalFabric,
    LocalTransport,
    PackLayoutError,
    RingSpace,
    TransportConfig,
    create_transport,
    gather,
    scatter_segments,
)
from transfer.probe import ProbeProcess
from transfer.ring import RING_ALIGN

L, H, D, BS = 4, 2, 8, 16
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype="float32")


def test_ring_reuses_space_in_order_and_never_wraps_a_piece():
    ring = RingSpace(4 * RING_ALIGN)
    assert [ring.place(RING_ALIGN) for _ in range(4)] == [0, 256, 512, 768]
    assert ring.place(1) is None  # full
    ring.release_oldest()
    assert ring.place(RING_ALIGN) == 0  # wraps to the freed start
    assert ring.place(1) is None
    ring.release_oldest()
    ring.release_oldest()
    assert ring.place(2 * RING_ALIGN) == 256  # [256, 768) is free again
    ring.release_oldest()
    ring.release_oldest()
    ring.release_oldest()
    assert ring.empty and ring.place(4 * RING_ALIGN) == 0
    assert RingSpace(RING_ALIGN).place(RING_ALIGN + 1) is None  # larger than the ring


class Decode:
    """Decode stand-in: a landing arena and paged caches per rank; scatters each landed
    piece (checking the flows tile the prompt) before answering its notice."""

    def __init__(self, fabric: LocalFabric, ranks: list[KVShard], region_bytes: int) -> None:
        self.transport = LocalTransport(fabric=fabric)
        self.arenas = [  # one landing buffer per rank, as every decode rank has its own
            LandingArena(16 << 20, self.transport, max_region_bytes=region_bytes) for _ in ranks
        ]
        self.ranks = ranks
        self.caches = {
            r: [torch.zeros(2, 64, BS, s.head_end - s.head_start, D) for _ in range(L)]
            for r, s in enumerate(ranks)
        }
        self.closed: dict[str, FlowClosed] = {}
        self.coverage: dict[str, FlowCoverage] = {}
        self.regions: dict[tuple[str, int], object] = {}
        self.gone: set[str] = set()
        self.lock = threading.Lock()

    def landing(self, rid: str, num_tokens: int) -> list[LandingInfo]:
        self.coverage[rid] = FlowCoverage(len(self.ranks), L, num_tokens)
        infos = []
        for r, s in enumerate(self.ranks):
            region = self.arenas[r].allocate(rid, num_tokens * LAYOUT.bytes_per_token, 1)
            assert region is not None
            self.regions[rid, r] = region
            heads = s.head_end - s.head_start
            layout = KVLayout(
                num_layers=L, num_kv_heads=heads, head_dim=D, block_size=BS, dtype="float32"
            )
            infos.append(
                LandingInfo(
                    r,
                    "local",
                    self.transport.peer_address,
                    region.addr,
                    region.nbytes,
                    layout,
                    s.head_start,
                    s.dcp_size,
                    s.dcp_rank,
                )
            )
        return infos

    def notify(self, url: str, notice: HandoffNotice) -> bool:
        with self.lock:
            if notice.request_id in self.gone:
                return False
            if isinstance(notice, FlowClosed):
                self.closed[notice.request_id] = notice
                return True
            assert isinstance(notice, SegmentsLanded)
            cov = self.coverage[notice.request_id]
            for seg in notice.segments:
                assert cov.check(seg) is None
                cov.add(seg)
                shard = self.ranks[seg.rank]
                caches = self.caches[seg.rank]
                heads = caches[0].shape[3]
                layout = KVLayout(
                    num_layers=L, num_kv_heads=heads, head_dim=D, block_size=BS, dtype="float32"
                )
                stripe = KVShard(dcp_size=shard.dcp_size, dcp_rank=shard.dcp_rank)
                table = list(range(64))
                region = self.regions[notice.request_id, seg.rank]
                scatter_segments(region, [seg], layout, caches, table, stripe)
            return True


def _prefill_cache() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, 64, BS, H, D) for _ in range(L)]


def _wait_closed(sender: HandoffSender, n: int, timeout_s: float = 20) -> dict[str, object]:
    done: dict[str, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < n and time.monotonic() < deadline:
        sender.wait_finished(0.05)
        for r in sender.finished():
            done[r.request_id] = r
    assert len(done) == n, f"only {list(done)} closed"
    return done


def _closed_at_decode(decode: Decode, rid: str, timeout_s: float = 5) -> FlowClosed:
    """The FlowClosed decode got (its notifier posts it after the flow reported closed)."""
    deadline = time.monotonic() + timeout_s
    while rid not in decode.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return decode.closed[rid]


def _expected(cache: list[torch.Tensor], table: list[int], n: int, shard: KVShard) -> torch.Tensor:
    """[L, 2, n_rank, h, D] of the shard's tokens and heads, read from paged KV."""
    toks = shard.tokens(0, n)
    slots = torch.tensor([table[t // BS] * BS + t % BS for t in toks.tolist()])
    h0, h1 = shard.head_start, shard.head_end
    return torch.stack([c.flatten(1, 2)[:, slots, h0:h1] for c in cache])


def _decoded(caches: list[torch.Tensor], n: int, shard: KVShard) -> torch.Tensor:
    local = shard.tokens(0, n) // shard.dcp_size
    return torch.stack([c.flatten(1, 2)[:, local] for c in caches])


@pytest.mark.parametrize(
    "ranks",
    [
        [KVShard(0, H)],
        [KVShard(0, 1, 2, 0), KVShard(0, 1, 2, 1), KVShard(1, 2, 2, 0), KVShard(1, 2, 2, 1)],
    ],
    ids=["one-rank", "tp4-dcp2"],
)
def test_streamed_kv_lands_exactly_through_a_small_ring(ranks):
    fabric = LocalFabric()
    cache = _prefill_cache()
    n = 700
    region = 96 * LAYOUT.bytes_per_token  # far smaller than the prompt: the ring turns
    decode = Decode(fabric, ranks, region)
    sender = HandoffSender(
        LocalTransport(fabric=fabric), 1 << 20, cache, (0, L), notify=decode.notify
    )
    try:
        table = list(range(63, -1, -1))  # non-contiguous blocks
        sender.open("r1", decode.landing("r1", n), n, "decode")
        for a in range(0, n, 256):  # one submit per prefill chunk
            sender.submit("r1", a, min(n, a + 256), table, last=a + 256 >= n)
        res = _wait_closed(sender, 1)["r1"]
        assert res.error is None
        assert _closed_at_decode(decode, "r1").error is None
        assert decode.coverage["r1"].complete
        assert res.num_bytes == n * LAYOUT.bytes_per_token  # each token once per head group
        for r, shard in enumerate(ranks):
            want = _expected(cache, table, n, shard)
            assert torch.equal(_decoded(decode.caches[r], n, shard), want)
    finally:
        sender.close()


def test_a_failed_write_fails_only_its_request_and_submit_never_waits():
    fabric = LocalFabric()
    cache = _prefill_cache()
    decode = Decode(fabric, [KVShard(0, H)], 128 * LAYOUT.bytes_per_token)
    faults = HandoffFaults(fail_prompt_tokens=300, write_delay_s=0.2)
    sender = HandoffSender(
        LocalTransport(fabric=fabric), 1 << 20, cache, (0, L), notify=decode.notify, faults=faults
    )
    try:
        table = list(range(64))
        sender.open("bad", decode.landing("bad", 300), 300, "decode")
        sender.open("good", decode.landing("good", 400), 400, "decode")
        started = time.perf_counter()
        sender.submit("bad", 0, 300, table, last=True)
        sender.submit("good", 0, 400, table, last=True)
        blocked = time.perf_counter() - started
        assert blocked < 0.1, f"submit blocked the caller {blocked:.4f}s"  # writes: 0.2 s each
        done = _wait_closed(sender, 2)
        assert done["good"].error is None and decode.coverage["good"].complete
        assert "injected fault" in (done["bad"].error or "")
        assert _closed_at_decode(decode, "bad").error == done["bad"].error
        assert not decode.coverage["bad"].complete
    finally:
        sender.close()


def test_cancel_closes_once_no_write_is_in_flight_and_decode_gone_stops_it():
    fabric = LocalFabric()
    cache = _prefill_cache()
    decode = Decode(fabric, [KVShard(0, H)], 32 * LAYOUT.bytes_per_token)
    sender = HandoffSender(
        LocalTransport(fabric=fabric),
        1 << 20,
        cache,
        (0, L),
        notify=decode.notify,
        faults=HandoffFaults(write_delay_s=0.05),
    )
    try:
        table = list(range(64))
        sender.open("a", decode.landing("a", 800), 800, "decode")
        sender.open("b", decode.landing("b", 800), 800, "decode")
        sender.submit("a", 0, 800, table, last=True)
        sender.submit("b", 0, 800, table, last=True)
        time.sleep(0.1)
        sender.cancel("a")
        decode.gone.add("b")  # decode aborted it: its next notice is answered 410
        done = _wait_closed(sender, 2)
        assert done["a"].error == "aborted"
        assert done["b"].error is not None
        assert _closed_at_decode(decode, "a").error == "aborted"
        assert not sender.in_flight("a") and not sender.in_flight("b")
    finally:
        sender.close()


class CountingTransport(LocalTransport):
    """A local transport that counts the ops it writes."""

    def __init__(self, fabric: LocalFabric) -> None:
        super().__init__(fabric=fabric)
        self.num_ops = 0

    def _write_batch(self, peer, ops) -> None:  # type: ignore[no-untyped-def]
        self.num_ops += len(ops)
        super()._write_batch(peer, ops)


@pytest.mark.parametrize(("split", "dcp"), [((2, 2), 1), ((3, 1), 2), ((1, 1, 1, 1), 1)])
def test_every_stage_sends_its_layers_to_every_rank(split: tuple[int, ...], dcp: int):
    """A pipelined prefill: one sender per stage (its layers only, its own transport),
    all streaming into the same decode ranks' rings; the flows tile every layer."""
    fabric = LocalFabric()
    cache = _prefill_cache()
    ranks = [KVShard(h, h + 1, dcp, r) for h in range(H) for r in range(dcp)]
    n = 900
    decode = Decode(fabric, ranks, 120 * LAYOUT.bytes_per_token)
    table = list(range(64))
    starts = [sum(split[:i]) for i in range(len(split))]
    senders = []
    for stage, (l0, nl) in enumerate(zip(starts, split, strict=True)):
        senders.append(
            HandoffSender(
                CountingTransport(fabric),
                1 << 20,
                cache[l0 : l0 + nl],
                (l0, l0 + nl),
                stage=stage,
                num_stages=len(split),
                notify=decode.notify,
            )
        )
    try:
        landing = decode.landing("r", n)
        for s in senders:
            s.open("r", landing, n, "decode")
        for a in range(0, n, 512):
            for s in senders:
                s.submit("r", a, min(n, a + 512), table, last=a + 512 >= n)
        results = [_wait_closed(s, 1)["r"] for s in senders]
        assert all(r.error is None for r in results)
        assert decode.coverage["r"].complete
        assert sum(r.num_bytes for r in results) == n * LAYOUT.bytes_per_token
        for s, r in zip(senders, results, strict=True):
            assert s.transport.num_ops == r.num_ops  # type: ignore[attr-defined]
        for r, shard in enumerate(ranks):
            assert torch.equal(
                _decoded(decode.caches[r], n, shard), _expected(cache, table, n, shard)
            )
    finally:
        for s in senders:
            s.close()


def test_ops_are_at_most_8_mib_and_a_mismatched_landing_is_refused():
    fabric = LocalFabric()
    torch.manual_seed(1)
    big = [torch.randn(2, 64, BS, 8, 128) for _ in range(L)]  # 32 KiB per token
    layout = KVLayout(num_layers=L, num_kv_heads=8, head_dim=128, block_size=BS, dtype="float32")
    t = CountingTransport(fabric)
    got: list[SegmentsLanded] = []

    def notify(url: str, notice: HandoffNotice) -> bool:
        if isinstance(notice, SegmentsLanded):
            got.append(notice)
        return True

    sender = HandoffSender(t, 96 << 20, big, (0, L), notify=notify)
    land = LandingArena(64 << 20, LocalTransport(fabric=fabric), max_region_bytes=64 << 20)
    try:
        n = 1000  # 32 MB: pieces of half the region (at most a 24 MiB staging slot)
        region = land.allocate("r", n * layout.bytes_per_token, 1)
        assert region is not None
        info = land.landing_info(region, 0, layout)
        wrong = land.landing_info(region, 0, LAYOUT)
        with pytest.raises(PackLayoutError, match="does not match"):
            sender.open("bad", [wrong], n, "decode")
        sender.open("r", [info], n, "decode")
        sender.submit("r", 0, n, list(range(64)), last=True)
        res = _wait_closed(sender, 1)["r"]
        assert res.error is None and res.num_bytes == n * layout.bytes_per_token
        sizes = [seg.num_bytes for s in got for seg in s.segments]
        assert max(sizes) > MAX_OP_BYTES  # multi-op writes ran
        assert res.num_ops == t.num_ops == sum(math.ceil(b / MAX_OP_BYTES) for b in sizes)
    finally:
        sender.close()


def test_send_over_mooncake_into_another_process():
    config = TransportConfig(name="mooncake", host="127.0.0.1", protocol="tcp")
    cache = _prefill_cache()
    n, table = 700, list(range(64))
    checked: list[int] = []

    with ProbeProcess(config, 1 << 20) as probe:

        def notify(url: str, notice: HandoffNotice) -> bool:
            # check each piece where it landed before answering: the ring reuses it after
            for seg in notice.segments if isinstance(notice, SegmentsLanded) else []:
                k = seg.token_end - seg.token_start
                want = torch.empty(L, 2, k, H, D)
                gather(cache, table, seg.token_start, seg.token_end, want)
                digest = hashlib.sha256(want.numpy().tobytes()).hexdigest()
                assert probe.sha256(seg.offset_bytes, seg.num_bytes) == digest
                checked.append(k)
            return True

        transport = create_transport(config)
        sender = HandoffSender(transport, 256 << 10, cache, (0, L), notify=notify)
        try:
            landing = LandingInfo(
                0, "mooncake", probe.peer, probe.buffer_addr, probe.nbytes, LAYOUT
            )
            sender.open("r", [landing], n, "decode")
            sender.submit("r", 0, n, table, last=True)
            assert _wait_closed(sender, 1)["r"].error is None
            assert sum(checked) == n and len(checked) > 1
        finally:
            sender.close()
            transport.close()

"""Engine-thread time per handoff: how long the thread that runs the model is held by the
P->D handoff, against how long the transfer takes.

    python -m benchmarks.handoff_async [--num-tokens 8192] [--chunk-tokens 2048] [--reps 3]

Workload (seeded): SmolLM2-135M-shaped KV (30 layers x 3 KV heads x 64, float32, 46,080
bytes per token: 8K tokens = 377 MB) in a paged cache with its blocks in a random order,
sent over Mooncake tcp on 127.0.0.1 into a landing ring in another process
(transfer/probe.py), one submit per prefill chunk, as the prefill engine does:

  async (the connector)   the engine thread calls HandoffWorker.start_saves(step meta)
                          once per chunk and get_finished() once per step; the packer,
                          writer and notifier threads move the bytes. Blocked = the time
                          inside those calls; transfer = first submit -> flow closed.
                          Decode's acknowledgement is immediate here (no scatter), so
                          the ring turns at transport speed.
  sync (the old path)     gather + write of each chunk on the calling thread, one staging
                          buffer: blocked = transfer.

A first run checks every landed segment against a reference pack (sha256, where it landed,
before it is answered); the timed reps use a region of --region-mib (the ring turns).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import time
from collections.abc import Callable

import msgspec
import torch

from benchmarks.handoff import LAYOUT, cpu_name, make_cache, mooncake_version, reference_pack
from engine.kv_connector import WorkerPlace
from prefill_worker.handoff import HandoffWorker
from protocol.handoff_messages import FlowOpen, FlowReport, FlowSend, HandoffMeta
from protocol.messages import HandoffNotice, KVSegment, LandingInfo, SegmentsLanded
from transfer import TransportConfig, create_transport, gather
from transfer.probe import ProbeProcess


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


class Acks:
    """Decode stand-in: answers at once; with `check`, first verifies every landed segment
    where it lies (the ring reuses its bytes once answered)."""

    def __init__(self) -> None:
        self.check: Callable[[KVSegment], None] | None = None
        self.num_checked = 0

    def __call__(self, url: str, notice: HandoffNotice) -> bool:
        if isinstance(notice, SegmentsLanded) and self.check is not None:
            for seg in notice.segments:
                self.check(seg)
                self.num_checked += seg.token_end - seg.token_start
        return True


def run_async(
    worker: HandoffWorker,
    table: list[int],
    n: int,
    chunk: int,
    landing: LandingInfo,
    rid: str,
) -> tuple[float, float, int, int]:
    """(engine-thread seconds, transfer seconds, bytes, ops) of one handoff."""
    blocked = 0.0
    started = time.perf_counter()
    for i, a in enumerate(range(0, n, chunk)):
        b = min(n, a + chunk)
        opens = [FlowOpen(rid, n, [landing], "decode")] if i == 0 else []
        meta = msgspec.msgpack.encode(HandoffMeta(opens, [FlowSend(rid, a, b, table, b == n)]))
        t0 = time.perf_counter()
        worker.start_saves(meta)
        report = worker.get_finished()
        blocked += time.perf_counter() - t0
        assert not report
    while True:
        worker.wait(0.001)  # the engine's idle poll (it sleeps: not blocked on the transfer)
        t0 = time.perf_counter()
        report = worker.get_finished()
        blocked += time.perf_counter() - t0
        if report:
            closed = msgspec.msgpack.decode(report, type=FlowReport).closed
            assert closed[0].error is None, closed[0].error
            return blocked, time.perf_counter() - started, closed[0].num_bytes, closed[0].num_ops


def run_sync(te, staging: torch.Tensor, caches, table, n, chunk, landing) -> float:  # type: ignore[no-untyped-def]
    """The old path: gather + write of every chunk on the calling thread."""
    started = time.perf_counter()
    offset = 0
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        out = staging[: (b - a) * LAYOUT.bytes_per_token].view(torch.float32)
        out = out.view(LAYOUT.num_layers, 2, b - a, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        gather(caches, table, a, b, out)
        nbytes = (b - a) * LAYOUT.bytes_per_token
        te.write(
            landing.peer,
            staging.data_ptr(),
            landing.buffer_addr + offset % landing.capacity_bytes,
            nbytes,
        )
        offset += nbytes
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-tokens", type=int, default=8192)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--region-mib", type=int, default=64)
    p.add_argument("--staging-mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n, chunk = args.num_tokens, args.chunk_tokens
    total = n * LAYOUT.bytes_per_token
    caches, table = make_cache(n, args.seed)
    config = TransportConfig(name="mooncake", host="127.0.0.1", protocol="tcp")
    buffer = max(total, args.region_mib << 20)
    rows = []
    with ProbeProcess(config, -(-buffer // 4096) * 4096, timeout_s=300) as probe:
        te = create_transport(config)
        acks = Acks()
        worker = HandoffWorker(te, args.staging_mib << 20, acks)
        worker.register_kv_caches(caches, WorkerPlace(0, LAYOUT.num_layers))

        # correctness: every landed segment checked where it landed, before it is answered
        expect = reference_pack(caches, table, n)

        def check(seg: KVSegment) -> None:
            want = expect[:, :, seg.token_start : seg.token_end]
            if probe.sha256(seg.offset_bytes, seg.num_bytes) != sha(want):
                raise SystemExit(f"segment {seg}: landed bytes differ from the reference")

        whole = LandingInfo(0, "mooncake", probe.peer, probe.buffer_addr, probe.nbytes, LAYOUT)
        acks.check = check
        run_async(worker, table, n, chunk, whole, "check")
        assert acks.num_checked == n, acks.num_checked
        acks.check = None

        ring = LandingInfo(
            0, "mooncake", probe.peer, probe.buffer_addr, args.region_mib << 20, LAYOUT
        )
        res = [run_async(worker, table, n, chunk, ring, f"r{i}") for i in range(args.reps)]
        worker.close()
        blocked = [r[0] for r in res]
        transfer = [r[1] for r in res]
        nbytes, ops = res[0][2], res[0][3]
        assert nbytes == total

        staging = torch.empty(chunk * LAYOUT.bytes_per_token, dtype=torch.uint8)
        te.register_buffer(staging.data_ptr(), staging.numel())
        sync = [run_sync(te, staging, caches, table, n, chunk, ring) for _ in range(args.reps)]
        te.close()

    med = statistics.median
    rows.append(
        f"| async connector (ring {args.region_mib} MiB) | {med(blocked) * 1e3:.2f} | "
        f"{med(transfer) * 1e3:.1f} | {100 * med(blocked) / med(transfer):.2f}% | "
        f"{total / med(transfer) / 1e9:.3f} | {ops} |"
    )
    rows.append(
        f"| sync gather + write (old) | {med(sync) * 1e3:.1f} | {med(sync) * 1e3:.1f} | 100% | "
        f"{total / med(sync) / 1e9:.3f} | - |"
    )
    print(
        f"# handoff_async: {n} tokens x {LAYOUT.bytes_per_token} B = {total / 1e6:.1f} MB, "
        f"{chunk}-token chunks, mooncake tcp 127.0.0.1, {args.reps} reps (median)"
    )
    print(
        f"# {platform.platform()}, {cpu_name()} x {os.cpu_count()}, "
        f"torch {torch.__version__}, mooncake {mooncake_version()}"
    )
    print("| path | engine thread blocked (ms) | transfer (ms) | blocked / transfer | GB/s | ops |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()

"""Handoff on one GPU: KV of a 1.8 GB context moved by the cuda_ipc transport, next to a
same-run device-to-device copy (the ceiling). Needs CUDA.

    python -m benchmarks.handoff_gpu [--num-tokens 14336] [--reps 5] [--out result.json]

Workload (seeded): Llama-3-8B-shaped KV, 32 layers x 8 KV heads x head_dim 128, bf16,
block size 16: 128 KiB per token, 14,336 tokens = 1.88 GB. Cases, each checked before it
is timed:
  d2d copy            one 1.88 GB tensor copy inside this process (the ceiling)
  cuda_ipc write      Transport.write of the packed context from this process's GPU
                      memory into a landing buffer another process exported (ops <= 8 MiB,
                      one event); checked by sha256 in the receiving process
  sender pipeline     the whole handoff in one process over cuda_ipc: prefill's
                      HandoffSender from a paged cache (blocks in a random order), per
                      2,048-token chunk: gather -> staging -> write into a GPU landing
                      region -> notice -> decode scatters into its pages (GPU to GPU) and
                      answers; with the staging a prefill worker has over Mooncake (64
                      MiB) and over cuda_ipc (1 GiB: 256 MiB pieces); all chunks at
                      once (GB/s), and paced as prefill computes them, one per 90 ms
                      (tail: last chunk submitted -> everything landed at decode)
                      decode's pages are checked against the prefill's
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from protocol.device_budget import handoff_staging_bytes
from protocol.kv_layout import KVLayout
from protocol.messages import HandoffNotice, SegmentsLanded
from transfer import (
    HandoffSender,
    LandingArena,
    LandingRegion,
    TransportConfig,
    create_transport,
    scatter_segments,
)
from transfer.probe import ProbeProcess

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
CHUNK_TOKENS = 2048
PREFILL_CHUNK_S = 0.09
"""A 2,048-token chunk of an 8B model takes ~90 ms to prefill on one H200 (22.7K tok/s):
the pace the handoff streams at in serving, where only its tail after the last chunk
delays decode."""


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def make_cache(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs, h, d = LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    num_blocks = -(-num_tokens // bs) * 9 // 8
    caches = [
        torch.randn(2, num_blocks, bs, h, d, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(LAYOUT.num_layers)
    ]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return caches, perm[: -(-num_tokens // bs)].tolist()


def reference_pack(caches: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """[L, 2, n, H, D]: what the landing must hold (token order, all layers)."""
    bs = LAYOUT.block_size
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)], device="cuda")
    return torch.stack([c.flatten(1, 2)[:, slots] for c in caches])


def bench_d2d(nbytes: int, reps: int) -> dict[str, float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    assert torch.equal(dst, src)
    secs = timed(lambda: dst.copy_(src), reps)
    return {"median_s": statistics.median(secs), "gb_per_s": nbytes / min(secs) / 1e9}


def bench_ipc_write(nbytes: int, reps: int) -> dict[str, float]:
    config = TransportConfig(name="cuda_ipc", host="127.0.0.1")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    transport = create_transport(config)
    transport.register_tensor(src)
    with ProbeProcess(config, nbytes, timeout_s=300, device="cuda") as peer:
        first = time.perf_counter()
        stats = transport.write(peer.peer, src.data_ptr(), peer.buffer_addr, nbytes)
        first_s = time.perf_counter() - first  # includes mapping the peer's buffer once
        want = hashlib.sha256(src.cpu().numpy().data).hexdigest()
        if peer.sha256(0, nbytes) != want:
            raise SystemExit("cuda_ipc write: the receiver's bytes differ from the source")
        secs = []
        for _ in range(reps):
            s = transport.write(peer.peer, src.data_ptr(), peer.buffer_addr, nbytes)
            secs.append(s.seconds)
    transport.close()
    return {
        "num_ops": stats.num_ops,
        "first_write_s": first_s,
        "median_s": statistics.median(secs),
        "gb_per_s": nbytes / min(secs) / 1e9,
        "gb_per_s_median": nbytes / statistics.median(secs) / 1e9,
    }


def bench_sender(num_tokens: int, staging_bytes: int, reps: int) -> dict[str, float]:
    caches, table = make_cache(num_tokens, seed=0)
    want = reference_pack(caches, table, num_tokens)
    nbytes = num_tokens * LAYOUT.bytes_per_token
    num_blocks = -(-num_tokens // LAYOUT.block_size)
    decode_caches = [torch.zeros_like(c[:, :num_blocks]) for c in caches]
    decode_table = list(range(num_blocks))
    recv = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
    arena = LandingArena(-(-nbytes // 4096) * 4096, recv, max_region_bytes=nbytes, device="cuda")
    regions: dict[str, LandingRegion] = {}

    def notify(url: str, notice: HandoffNotice) -> bool:
        """Decode's part: scatter the piece GPU to GPU, wait for it, then answer."""
        if isinstance(notice, SegmentsLanded):
            region = regions[notice.request_id]
            scatter_segments(region, notice.segments, LAYOUT, decode_caches, decode_table)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            done.synchronize()
        return True

    send = create_transport(TransportConfig(name="cuda_ipc", host="127.0.0.1"))
    sender = HandoffSender(send, staging_bytes, caches, (0, LAYOUT.num_layers), notify=notify)

    def one(rid: str, pace_s: float = 0.0) -> tuple[float, float]:
        """(seconds from the first submit, seconds from the last submit) to the flow's
        close; chunks are submitted `pace_s` apart (0: all at once)."""
        region = arena.allocate(rid, nbytes, 5)
        assert region is not None
        regions[rid] = region
        info = arena.landing_info(region, 0, LAYOUT)
        t0 = time.perf_counter()
        sender.open(rid, [info], num_tokens, "decode")
        for a in range(0, num_tokens, CHUNK_TOKENS):
            if a and pace_s:
                time.sleep(pace_s)
            b = min(num_tokens, a + CHUNK_TOKENS)
            t_last = time.perf_counter()
            sender.submit(rid, a, b, table, last=b == num_tokens)
        while not (res := sender.finished()):
            sender.wait_finished(0.01)
        end = time.perf_counter()
        if res[0].error is not None:
            raise SystemExit(f"sender: {res[0].error}")
        arena.free(rid)
        return end - t0, end - t_last

    try:
        one("check")
        for layer, c in enumerate(decode_caches):
            if not torch.equal(c.flatten(1, 2)[:, :num_tokens], want[layer]):
                raise SystemExit(f"sender pipeline: layer {layer} at decode differs from prefill")
        secs = [one(f"r{i}")[0] for i in range(reps)]
        tails = [one(f"p{i}", PREFILL_CHUNK_S)[1] for i in range(reps)]
    finally:
        sender.close()
        arena.close()
    return {
        "staging_mib": staging_bytes >> 20,
        "median_s": statistics.median(secs),
        "gb_per_s": nbytes / min(secs) / 1e9,
        "gb_per_s_median": nbytes / statistics.median(secs) / 1e9,
        "paced_tail_ms_median": 1e3 * statistics.median(tails),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-tokens", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.handoff_gpu needs a CUDA device")
    nbytes = args.num_tokens * LAYOUT.bytes_per_token
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "num_tokens": args.num_tokens,
        "context_bytes": nbytes,
    }
    result["d2d_copy"] = bench_d2d(nbytes, args.reps)
    result["cuda_ipc_write"] = bench_ipc_write(nbytes, args.reps)
    for protocol in ("tcp", "cuda_ipc"):  # the staging a prefill worker has for each
        staging = handoff_staging_bytes(protocol)
        result[f"sender_staging_{staging >> 20}mib"] = bench_sender(args.num_tokens, staging, 3)
    print(json.dumps(result, indent=2))
    d2d = result["d2d_copy"]["gb_per_s"]  # type: ignore[index]
    print(f"\ncontext {nbytes / 1e9:.2f} GB ({args.num_tokens} tokens) on {result['device']}")
    for key, r in result.items():
        if not isinstance(r, dict):
            continue
        tail = (
            f"  paced tail {r['paced_tail_ms_median']:.1f} ms"
            if "paced_tail_ms_median" in r
            else ""
        )
        print(
            f"  {key:24s} {r['gb_per_s']:8.1f} GB/s  ({r['gb_per_s'] / d2d:5.1%} of d2d copy){tail}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

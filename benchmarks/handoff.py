"""Handoff micro-benchmark: KV of one long prompt from a paged cache in this process to a
landing buffer in another process, over Mooncake tcp on 127.0.0.1.

    python -m benchmarks.handoff [--num-tokens 8192] [--per-token-prefix 512] [--reps 3]

Workload (seeded): SmolLM2-135M-shaped KV, 30 layers x 3 KV heads x head_dim 64, float32,
block size 16 (46,080 bytes per token: 8K tokens = 377 MB), blocks in a random order.
Cases, each checked byte for byte in the receiver (sha256) before it is timed:
  gathered, one send     gather of all tokens into a registered staging buffer (kv_pack),
                         then one Transport.write: ceil(bytes / 8 MiB) ops
  gathered, streamed     the same per 512-token prefill chunk (the worker's pattern;
                         benchmarks/handoff_async.py runs the real sender threads)
  gather only / write only   the two halves of the one-send case
  per-token batched      one op per (token, layer, K|V) straight from the paged cache,
                         in batches of 1024; timed on a token prefix, extrapolated
  per-token unbatched    the same ops, one write call each; shorter prefix, extrapolated
  local memcpy ceiling   the packed segment memmoved within this process ("local")
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from protocol.kv_layout import KVLayout
from protocol.messages import LandingInfo
from transfer import (
    LocalTransport,
    Transport,
    TransportConfig,
    WriteOp,
    WriteStats,
    create_transport,
    gather,
)
from transfer.probe import ProbeProcess

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def make_cache(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Paged cache with 25% spare blocks; the request's blocks in a random order."""
    g = torch.Generator().manual_seed(seed)
    bs, h, d = LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    num_blocks = -(-num_tokens // bs) * 5 // 4
    caches = [torch.randn(2, num_blocks, bs, h, d, generator=g) for _ in range(LAYOUT.num_layers)]
    table = torch.randperm(num_blocks, generator=g)[: -(-num_tokens // bs)].tolist()
    return caches, table


def reference_pack(caches: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """[L, 2, n, H, D] by advanced indexing: a code path independent of kv_pack."""
    t = torch.arange(n)
    blocks = torch.tensor(table)[t // LAYOUT.block_size]
    return torch.stack([kv[:, blocks, t % LAYOUT.block_size] for kv in caches])


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


def per_token_ops(
    caches: list[torch.Tensor], table: list[int], n: int, landing_addr: int
) -> list[WriteOp]:
    """One op per (layer, K|V, token): 768 bytes from the paged slot to its place in a
    packed [L, 2, n, H, D] segment (a token's K and V are not adjacent on either side)."""
    bs, tok = LAYOUT.block_size, LAYOUT.bytes_per_token_per_layer // 2
    ops = []
    for layer, kv in enumerate(caches):
        for k in range(2):
            base = kv[k].data_ptr()
            for t in range(n):
                src = base + (table[t // bs] * bs + t % bs) * tok
                ops.append(WriteOp(src, landing_addr + ((layer * 2 + k) * n + t) * tok, tok))
    return ops


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def row(name: str, nbytes: int, ops: int, secs: list[float], note: str = "") -> str:
    med, best = statistics.median(secs), min(secs)
    return (
        f"| {name} | {nbytes / 1e6:,.1f} | {ops:,} | {med * 1e3:,.1f} | "
        f"{nbytes / med / 1e9:.3f} | {nbytes / best / 1e9:.3f} | {note} |"
    )


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
    return names[0] if names else platform.machine()


def mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-tokens", type=int, default=8192)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--per-token-prefix", type=int, default=512)
    p.add_argument("--unbatched-prefix", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = args.num_tokens
    total = n * LAYOUT.bytes_per_token
    caches, table = make_cache(n, args.seed)
    expect = reference_pack(caches, table, n)
    config = TransportConfig(name="mooncake", host="127.0.0.1", protocol="tcp")
    rows: list[str] = []

    with ProbeProcess(config, -(-total // 4096) * 4096, timeout_s=300) as probe:
        te: Transport = create_transport(config)
        landing = LandingInfo(0, "mooncake", probe.peer, probe.buffer_addr, probe.nbytes, LAYOUT)

        def check(what: str, offset: int, want: torch.Tensor) -> None:
            got = probe.sha256(offset, want.numel() * want.element_size())
            if got != sha(want):
                raise SystemExit(f"{what}: landed bytes differ from the reference")

        # (a) gathered writes, staging big enough for the whole segment.
        staging_buf = torch.empty(total, dtype=torch.uint8)
        te.register_buffer(staging_buf.data_ptr(), total)

        def send(a: int, b: int, offset: int) -> WriteStats:
            out = staging_buf[: (b - a) * LAYOUT.bytes_per_token].view(torch.float32)
            out = out.view(LAYOUT.num_layers, 2, b - a, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            gather(caches, table, a, b, out)
            nbytes = (b - a) * LAYOUT.bytes_per_token
            return te.write(
                landing.peer, staging_buf.data_ptr(), landing.buffer_addr + offset, nbytes
            )

        one_send = lambda: send(0, n, 0)  # noqa: E731
        probe.fill(0)
        stats = one_send()
        check("one send", 0, expect)
        rows.append(
            row(
                "gathered, one send (gather + write)",
                total,
                stats.num_ops,
                timed(one_send, args.reps),
            )
        )

        def streamed() -> WriteStats:
            acc = WriteStats()
            for a in range(0, n, args.chunk_tokens):
                acc += send(a, min(a + args.chunk_tokens, n), acc.num_bytes)
            return acc

        probe.fill(0)
        s_stats = streamed()
        # Each chunk is its own [L, 2, c, H, D] segment: check chunk by chunk.
        chunk = args.chunk_tokens
        for a in range(0, n, chunk):
            check(f"chunk {a}", a * LAYOUT.bytes_per_token, expect[:, :, a : a + chunk])
        rows.append(
            row(
                f"gathered, streamed {chunk}-token sends",
                total,
                s_stats.num_ops,
                timed(streamed, args.reps),
            )
        )

        staging = staging_buf.view(torch.float32).view(expect.shape)
        rows.append(
            row(
                "gather only (pack into staging)",
                total,
                0,
                timed(lambda: gather(caches, table, 0, n, staging), args.reps),
            )
        )
        write = lambda: te.write(probe.peer, staging_buf.data_ptr(), probe.buffer_addr, total)  # noqa: E731
        rows.append(
            row("write only (staging -> landing)", total, stats.num_ops, timed(write, args.reps))
        )

        # (b) one op per token per layer (K and V separately), from the paged cache.
        for kv in caches:
            te.register_buffer(kv.data_ptr(), kv.numel() * kv.element_size())
        m = min(args.per_token_prefix, n)
        ops = per_token_ops(caches, table, m, probe.buffer_addr)
        probe.fill(0)
        te.write_ops(probe.peer, ops)
        check("per-token", 0, expect[:, :, :m])
        scale = n / m
        secs = [s * scale for s in timed(lambda: te.write_ops(probe.peer, ops), args.reps)]
        rows.append(
            row(
                "per-token ops, batched 1024",
                total,
                round(len(ops) * scale),
                secs,
                f"timed {m} tokens, x{scale:g}",
            )
        )

        u = min(args.unbatched_prefix, n)
        uops = per_token_ops(caches, table, u, probe.buffer_addr)
        probe.fill(0)
        for op in uops:
            te.write_ops(probe.peer, [op])
        check("per-token unbatched", 0, expect[:, :, :u])
        scale = n / u
        secs = [
            s * scale for s in timed(lambda: [te.write_ops(probe.peer, [op]) for op in uops], 1)
        ]
        rows.append(
            row(
                "per-token ops, one call each",
                total,
                round(len(uops) * scale),
                secs,
                f"timed {u} tokens, x{scale:g}",
            )
        )
        te.close()

    # (c) the same bytes moved within one process: the memcpy ceiling.
    local = LocalTransport()
    src = expect.contiguous().view(-1).view(torch.uint8)
    dst = torch.zeros_like(src)
    local.register_buffer(src.data_ptr(), total)
    local.register_buffer(dst.data_ptr(), total)
    lwrite = lambda: local.write(local.peer_address, src.data_ptr(), dst.data_ptr(), total)  # noqa: E731
    lstats = lwrite()
    if not torch.equal(src, dst):
        raise SystemExit("local copy differs")
    rows.append(
        row("local memcpy ceiling (same process)", total, lstats.num_ops, timed(lwrite, args.reps))
    )

    print(
        f"# handoff: {n} tokens x {LAYOUT.bytes_per_token} B = {total / 1e6:.1f} MB, mooncake tcp 127.0.0.1"
    )
    print(
        f"# {platform.platform()}, {cpu_name()} x {os.cpu_count()}, "
        f"torch {torch.__version__}, mooncake {mooncake_version()}, "
        f"reps {args.reps} (per-token unbatched: 1)"
    )
    print("| case | MB | ops | median ms | GB/s (median) | GB/s (best) | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

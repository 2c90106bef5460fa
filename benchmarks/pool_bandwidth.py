"""Pool read bandwidth on one host: GB/s of batch gets of N MiB objects into the
registered pool buffer, by where the objects live and how the reader reads them.

    python -m benchmarks.pool_bandwidth [--object-mib 4] [--objects 64] [--reps 5]
                                        [--modes store,clients2,stores2,in_prefill,
                                                 in_prefill_direct]

Starts a real pool (`python -m kvpool.master` + `python -m kvpool.store` services,
127.0.0.1, Mooncake tcp), then per mode: writes `--objects` random objects, reads them
all back with one batch get (`batch_get_into`) into the reader's registered buffer,
checks every byte once, and times `--reps` further reads (median and best).

    store       the default deployment: the objects in a separate store-service
                process, the reader a pure client (kvpool's "mooncake" backend)
    storesK     the same with K store services, the objects spread over them
    clientsK    K pure clients in the reader, the batch split across them in threads
                (one Mooncake transfer engine, hence one TCP I/O thread, per client)
    in_prefill  the reader mounts its own segment (`pool.stores[].prefill`,
                BackendConfig.segment_bytes): its puts land there, reads are Mooncake's
                same-process memcpy
    in_prefill_direct  the same segment, read in place (PoolBackend.locate: one
                batch_get_replica_desc, then the bytes are readable at their address in
                the segment, as PoolClient.read(in_place=True) uses them): the time is
                the lookup alone, the GB/s the bytes made readable per second; the bytes
                are checked at their address once
    memcpy      one torch copy of the same bytes in this process (the ceiling)

Every object is written by the reader itself, as a prefill instance restores what it
saved; objects other instances saved are read as in `store`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from benchmarks.handoff import cpu_name, mooncake_version
from benchmarks.pool_restore import HOST, LocalPool
from kvpool.backend import BackendConfig, PoolBackend, create_backend

MiB = 1 << 20


def _get(backend: PoolBackend, keys: list[str], ptrs: list[int], size: int) -> None:
    got = backend.get_into(keys, ptrs, [size] * len(keys))
    bad = [(k, g) for k, g in zip(keys, got, strict=True) if g != size]
    if bad:
        raise SystemExit(f"{len(bad)} of {len(keys)} reads failed, e.g. {bad[0]}")


def run_mode(
    mode: str, pool: LocalPool, buf: torch.Tensor, size: int, n: int, reps: int
) -> tuple[float, float]:
    """(median, best) seconds of one batch read of n objects of `size` bytes."""
    clients = int(mode.removeprefix("clients")) if mode.startswith("clients") else 1
    segment = n * size + 64 * MiB if mode.startswith("in_prefill") else 0
    backends = [
        create_backend(
            "mooncake",
            BackendConfig(
                HOST,
                pool.master_address,
                segment_bytes=segment if i == 0 else 0,
                master_http=pool.master_http,
            ),
        )
        for i in range(clients)
    ]
    base = buf.data_ptr()
    try:
        for b in backends:
            b.register_buffer(base, buf.numel())
        keys = [f"bw/{mode}/{i}" for i in range(n)]
        src = [base + i * size for i in range(n)]
        dst = [base + (n + i) * size for i in range(n)]
        ok = backends[0].put_from(keys, src, [size] * n, [""] * n)
        if not all(s.name == "OK" for s in ok):
            raise SystemExit(f"{mode}: a put failed: {ok}")
        parts = [list(range(c, n, clients)) for c in range(clients)]
        if mode == "in_prefill_direct":
            return _in_place(backends[0], keys, buf[: n * size], size, reps)

        def read() -> None:
            if clients == 1:
                _get(backends[0], keys, dst, size)
                return
            threads = [
                threading.Thread(
                    target=_get,
                    args=(b, [keys[i] for i in idx], [dst[i] for i in idx], size),
                )
                for b, idx in zip(backends, parts, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        half = n * size
        buf[half:].zero_()
        read()
        if not torch.equal(buf[:half], buf[half:]):
            raise SystemExit(f"{mode}: the bytes read differ from those written")
        secs = []
        for _ in range(reps):
            buf[half:].zero_()
            t = time.perf_counter()
            read()
            secs.append(time.perf_counter() - t)
        if not torch.equal(buf[:half], buf[half:]):
            raise SystemExit(f"{mode}: the bytes read differ from those written")
        return statistics.median(secs), min(secs)
    finally:
        for b in backends:
            b.unregister_buffer(base)
            b.close()


def _in_place(
    backend: PoolBackend, keys: list[str], want: torch.Tensor, size: int, reps: int
) -> tuple[float, float]:
    """Locate the objects in the own segment; check their bytes there once; time the
    lookups (what a restore's read costs when it reads them in place)."""
    found = backend.locate(keys)
    if any(r is None or r.size != size for r in found):
        raise SystemExit(f"in_prefill_direct: {sum(r is None for r in found)} objects not in place")
    for i, rep in enumerate(found):
        assert rep is not None
        view = torch.frombuffer((ctypes.c_uint8 * size).from_address(rep.ptr), dtype=torch.uint8)
        if not torch.equal(view, want[i * size : (i + 1) * size]):
            raise SystemExit("in_prefill_direct: the bytes in place differ from those written")
    return timed(lambda: backend.locate(keys), reps)


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    secs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t)
    return statistics.median(secs), min(secs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--object-mib", type=int, default=4)
    p.add_argument("--objects", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default="store,stores2,clients2,in_prefill,in_prefill_direct")
    args = p.parse_args()
    torch.set_num_threads(1)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    size, n = args.object_mib * MiB, args.objects
    total = size * n
    stores = max([int(m.removeprefix("stores")) for m in modes if m.startswith("stores")] + [1])
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST
    buf = torch.empty(2 * total, dtype=torch.uint8)
    buf[:total] = torch.randint(0, 256, (total,), dtype=torch.uint8)
    rows: list[tuple[str, float, float]] = []
    # every store holds every mode's objects (spread over them in storesK)
    with LocalPool(len(modes) * total + 64 * MiB, num_stores=stores) as pool:
        for mode in modes:
            med, best = run_mode(mode, pool, buf, size, n, args.reps)
            rows.append((mode, med, best))
            print(f"{mode}: {total / med / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
    med, best = timed(lambda: buf[total:].copy_(buf[:total]), args.reps)
    rows.append(("memcpy", med, best))
    print(
        f"pool reads: one batch get of {n} x {args.object_mib} MiB objects ({total / 1e6:.0f} MB) "
        f"into the registered buffer, median / best of {args.reps}\n"
        f"machine: {cpu_name()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"Mooncake {mooncake_version()} tcp on 127.0.0.1, {stores} store service(s)\n"
    )
    print("| mode | GB/s | GB/s, best | ms |")
    print("|---|---:|---:|---:|")
    for mode, med, best in rows:
        print(f"| {mode} | {total / med / 1e9:.2f} | {total / best / 1e9:.2f} | {med * 1e3:.2f} |")


if __name__ == "__main__":
    main()

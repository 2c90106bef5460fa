"""Pool save and restore throughput per prefill stage, on CPU over Mooncake tcp (loopback).

    python -m benchmarks.pool_restore [--chunks 8] [--split 8,8,7,7] [--reps 3] [--threads 1]
                                      [--in-prefill [--in-place]]

Starts a real pool (`python -m kvpool.master` + two `python -m kvpool.store`, 127.0.0.1),
(`--in-prefill`: the client also mounts its own segment, as a prefill
with `pool.stores[].prefill` does, so its objects are saved and restored in-process;
`--in-place` then reads them where they are in that segment, PoolClient.read(in_place=True):
"read" is the replica lookup + header checks, "unpack" the unpack straight from the
segment + the payload checksums of what it unpacked, PoolClient.confirm),
then for SmolLM2-135M-shaped KV (30 layers x 3 KV heads x head_dim 64, float32: 11.8 MB
per 256-token chunk) split into PP stages, per stage:

  save     pack   copy the stage's layers of each chunk's 16 blocks from the paged cache
                  into registered save slots (prefill_worker.pool_connector.pack_blocks)
           write  seal (header + xxh3_64 of the payload) and batch_put_from, grouped
  restore  read   batch_get_into the registered load slots + verify header and checksum
           unpack copy each chunk into 16 other blocks of a second paged cache
                  (unpack_blocks)

Correctness first: every restored token of every layer must equal the source, compared
with an independent reference (advanced indexing), before anything is timed. Each timed
save writes new keys (a put of an existing key is a no-op). `memcpy` is one torch copy
of the same bytes in this process: the ceiling of any CPU path here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml
from prometheus_client import CollectorRegistry

from benchmarks.handoff import cpu_name, mooncake_version
from kvpool.backend import BackendConfig, create_backend
from kvpool.client import PoolClient
from kvpool.metrics import PoolMetrics
from prefill_worker.pool_connector import pack_blocks, unpack_blocks
from protocol.ids import ChunkKey
from protocol.kv_layout import KVLayout
from protocol.namespace import KVNamespace

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
CHUNK = 256
HOST = "127.0.0.1"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class LocalPool:
    """A master and `num_stores` store services on 127.0.0.1, for the length of a `with`."""

    def __init__(self, store_bytes: int, num_stores: int = 2) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="pool-bench-"))
        ports = [free_port() for _ in range(4 + num_stores)]
        cfg = {
            "name": "poolbench",
            "model": "builtin:smollm2-135m-instruct",
            "nodes": [{"name": "local", "host": HOST}],
            "pool": {
                "master": {"node": "local", "port": ports[0], "metrics_port": ports[1]},
                "stores": [
                    {"node": "local", "numa_node": i, "size": store_bytes, "metrics_port": p}
                    for i, p in enumerate(ports[4:])
                ],
            },
            "prefill": [{"name": "p", "node": "local", "port": ports[2], "devices": ["cpu"]}],
            "decode": [{"name": "d", "node": "local", "port": ports[3], "devices": ["cpu"]}],
        }
        self.config = self.tmp / "pool.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.master_address = f"{HOST}:{ports[0]}"
        self.master_http = f"{HOST}:{ports[1]}"
        self.health = [f"http://{HOST}:{p}/health" for p in [ports[1], *ports[4:]]]
        self.num_stores = num_stores
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> LocalPool:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": HOST}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        cmds = [["kvpool.master", "--node", "local"]] + [
            ["kvpool.store", "--index", str(i)] for i in range(self.num_stores)
        ]
        for i, cmd in enumerate(cmds):
            log = open(self.tmp / f"{i}.log", "ab")
            argv = [sys.executable, "-m", cmd[0], "-c", str(self.config), *cmd[1:]]
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))
            self._wait(self.health[i])
        return self

    @staticmethod
    def _wait(url: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"{url} did not become healthy")

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):  # stores first, then the master
            p.terminate()
            p.wait(timeout=20)


def make_cache(num_tokens: int, seed: int, fill: bool) -> tuple[list[torch.Tensor], list[int]]:
    """A paged cache with 25% spare blocks; the request's blocks in a random order."""
    g = torch.Generator().manual_seed(seed)
    bs, h, d = LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    num_blocks = -(-num_tokens // bs) * 5 // 4
    shape = (2, num_blocks, bs, h, d)
    caches = [
        torch.randn(shape, generator=g) if fill else torch.zeros(shape)
        for _ in range(LAYOUT.num_layers)
    ]
    table = torch.randperm(num_blocks, generator=g)[: -(-num_tokens // bs)].tolist()
    return caches, table


def reference_pack(caches: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """[L, 2, n, H, D] by advanced indexing: a code path independent of kv_pack."""
    t = torch.arange(n)
    blocks = torch.tensor(table)[t // LAYOUT.block_size]
    return torch.stack([kv[:, blocks, t % LAYOUT.block_size] for kv in caches])


def keys_for(tag: int, n: int) -> list[ChunkKey]:
    return [ChunkKey((tag * 100_000 + c).to_bytes(8, "little") * 2) for c in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--split", default="8,8,7,7", help="layers per prefill stage")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (a prefill on a 2-core node gets 1; more oversubscribe here)",
    )
    p.add_argument(
        "--in-prefill",
        action="store_true",
        help="the client mounts its own segment (pool.stores[].prefill): saves land there",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="with --in-prefill: restores read the own segment in place (no copy)",
    )
    args = p.parse_args()
    if args.in_place and not args.in_prefill:
        p.error("--in-place reads the client's own segment: add --in-prefill")
    torch.set_num_threads(args.threads)
    split = tuple(int(x) for x in args.split.split(","))
    assert sum(split) == LAYOUT.num_layers, f"the split must cover {LAYOUT.num_layers} layers"
    n_chunks, n_tok = args.chunks, args.chunks * CHUNK
    ns = KVNamespace(
        weights_fingerprint="bench", kv_dtype="float32", block_size=16, layer_split=split, rope="-"
    )
    src, src_table = make_cache(n_tok, args.seed, fill=True)
    dst, dst_table = make_cache(n_tok, args.seed + 1, fill=False)
    expect = reference_pack(src, src_table, n_tok)
    chunk_bytes = CHUNK * LAYOUT.bytes_per_token
    store_bytes = max(16 << 20, chunk_bytes * n_chunks * (args.reps + 2))
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST

    with LocalPool(store_bytes) as pool:
        segment = store_bytes if args.in_prefill else 0
        backend = create_backend(
            "mooncake",
            BackendConfig(
                HOST, pool.master_address, segment_bytes=segment, master_http=pool.master_http
            ),
        )
        metrics = PoolMetrics(CollectorRegistry(), "bench")
        max_stage = max(split) * chunk_bytes // LAYOUT.num_layers + 8192
        client = PoolClient(
            backend,
            ns,
            LAYOUT,
            buffer_bytes=2 * n_chunks * len(split) * max_stage + (1 << 20),
            max_save_chunks=n_chunks,
            metrics=metrics,
        )
        stages = client.local_stages
        save_ids = client.buffer.save_slot_ids
        load_ids = client.buffer.load_slot_ids
        slots = {
            s.index: (
                save_ids[i * n_chunks : (i + 1) * n_chunks],
                load_ids[i * n_chunks :][:n_chunks],
            )
            for i, s in enumerate(stages)
        }

        def pack(stage_i: int) -> None:
            s = stages[stage_i]
            spec = client.specs[s.index]
            bpc = CHUNK // LAYOUT.block_size
            for c, slot in enumerate(slots[s.index][0]):
                out = client.buffer.payload(slot, spec)
                blocks = src_table[c * bpc : (c + 1) * bpc]
                pack_blocks(src[s.layer_start : s.layer_end], blocks, out)  # type: ignore[arg-type]

        def write(stage_i: int, tag: int) -> None:
            s = stages[stage_i]
            ok = client.write(s.index, keys_for(tag, n_chunks), slots[s.index][0])
            assert all(ok), "a save failed"

        def read(stage_i: int, tag: int) -> None:
            s = stages[stage_i]
            keys = keys_for(tag, n_chunks)
            got = client.read(s.index, keys, slots[s.index][1], in_place=args.in_place)
            assert got == n_chunks, f"stage {s.index}: {got} of {n_chunks} chunks verified"
            placed = sum(client.buffer.in_place(slot) for slot in slots[s.index][1])
            assert placed == (n_chunks if args.in_place else 0), f"{placed} read in place"

        def unpack(stage_i: int) -> None:
            s = stages[stage_i]
            spec = client.specs[s.index]
            bpc = CHUNK // LAYOUT.block_size
            for c, slot in enumerate(slots[s.index][1]):
                blocks = dst_table[c * bpc : (c + 1) * bpc]
                unpack_blocks(
                    client.buffer.payload(slot, spec),
                    dst[s.layer_start : s.layer_end],
                    blocks,  # type: ignore[arg-type]
                )
            if args.in_place:  # the payloads' checksums, over the bytes unpacked
                keys = keys_for(0, n_chunks)
                got = client.confirm(s.index, keys, slots[s.index][1], n_chunks)
                assert got == n_chunks, f"stage {s.index}: {got} of {n_chunks} confirmed"

        # Correctness first: save, restore into the other cache, compare with the reference.
        for i in range(len(stages)):
            pack(i)
            write(i, tag=0)
            read(i, tag=0)
            unpack(i)
        if not torch.equal(reference_pack(dst, dst_table, n_tok), expect):
            raise SystemExit("restored KV differs from the source: not timing a wrong path")

        def timed(fn, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
            """(median, best) seconds."""
            secs = []
            for r in range(reps):
                t = time.perf_counter()
                fn(r)
                secs.append(time.perf_counter() - t)
            return statistics.median(secs), min(secs)

        rows = []
        totals = {"save": 0.0, "restore": 0.0, "best_restore": 0.0}
        for i, s in enumerate(stages):
            nbytes = client.specs[s.index].payload_bytes * n_chunks
            t_pack, _ = timed(lambda _r, i=i: pack(i), args.reps)
            t_write, _ = timed(lambda r, i=i: write(i, tag=1 + r), args.reps)
            # A restore is a read then an unpack (in place, the unpack and its confirm
            # need the read before them): timed in pairs, as the load thread runs them.
            pairs = []
            for _ in range(args.reps):
                t = time.perf_counter()
                read(i, tag=0)
                t_mid = time.perf_counter()
                unpack(i)
                pairs.append((t_mid - t, time.perf_counter() - t_mid))
            t_read = statistics.median(p[0] for p in pairs)
            t_unpack = statistics.median(p[1] for p in pairs)
            b_read, b_unpack = min(pairs, key=sum)
            totals["save"] += t_pack + t_write
            totals["restore"] += t_read + t_unpack
            totals["best_restore"] += b_read + b_unpack
            rows.append((s, nbytes, t_pack, t_write, t_read, t_unpack, b_read + b_unpack))
        total_bytes = n_chunks * chunk_bytes
        flat = torch.empty(total_bytes // 4)
        flat_src = expect.reshape(-1)
        memcpy, memcpy_best = timed(lambda _r: flat.copy_(flat_src), args.reps)
        backend_close = client.close
        backend_close()

    gbs = lambda nbytes, s: nbytes / s / 1e9  # noqa: E731
    print(
        f"pool save/restore, {n_chunks} chunks x {CHUNK} tokens, split {list(split)}, "
        f"float32 SmolLM2-135M KV ({chunk_bytes / 1e6:.1f} MB per chunk), median of {args.reps}"
    )
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__} "
        f"({args.threads} thread(s)); "
        f"Mooncake {mooncake_version()} tcp on 127.0.0.1, 2 store services"
        + (", the client's own segment (--in-prefill)" if args.in_prefill else "")
        + (", read in place (--in-place)" if args.in_place else "")
        + "\n"
    )
    print(
        "| stage | layers | MB | pack GB/s | write GB/s | save GB/s | read+verify GB/s "
        "| unpack GB/s | restore GB/s | restore ms | restore GB/s, best |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s, nbytes, tp, tw, tr, tu, best in rows:
        print(
            f"| {s.index} | {s.layer_start}-{s.layer_end - 1} | {nbytes / 1e6:.1f} | "
            f"{gbs(nbytes, tp):.2f} | {gbs(nbytes, tw):.2f} | {gbs(nbytes, tp + tw):.2f} | "
            f"{gbs(nbytes, tr):.2f} | {gbs(nbytes, tu):.2f} | {gbs(nbytes, tr + tu):.2f} | "
            f"{(tr + tu) * 1e3:.0f} | {gbs(nbytes, best):.2f} |"
        )
    print(
        f"| all, one after another | 0-{LAYOUT.num_layers - 1} | {total_bytes / 1e6:.1f} | | | "
        f"{gbs(total_bytes, totals['save']):.2f} | | | {gbs(total_bytes, totals['restore']):.2f} "
        f"| {totals['restore'] * 1e3:.0f} | {gbs(total_bytes, totals['best_restore']):.2f} |"
    )
    print(
        f"\nmemcpy of the same bytes in this process: {gbs(total_bytes, memcpy):.2f} GB/s "
        f"(best {gbs(total_bytes, memcpy_best):.2f}); columns are medians of {args.reps}, "
        "the last is the best run"
    )
    print(
        "restore: first stage start to last stage done = the 'restore ms' of the slowest "
        "stage when stages run in their own processes (PP), the 'all' row here."
    )


if __name__ == "__main__":
    main()

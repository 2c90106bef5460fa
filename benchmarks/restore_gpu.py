"""Pool restore on GPUs: registered pinned host buffer (where the pool's zero-copy reads
land) -> paged GPU KV, one prefill stage per GPU, against the pinned host->device ceiling
measured in the same run.

    python benchmarks/restore_gpu.py [--tokens 32768] [--layers 32] [--kv-heads 8]
        [--head-dim 128] [--dtype bfloat16] [--stages N]

Each stage holds its layers of every 256-token chunk as pool objects (kvpool's object
format v2: header + [L_s, 2, 256, H, D] payload + payload checksum) in one pinned buffer,
and a paged KV cache [2, blocks, 16, H, D] per layer on its GPU with a shuffled block
table. Restore = per group of 8 chunks: one async H2D copy into a GPU staging buffer → one
scatter per layer into the pages, two groups in flight on two CUDA streams. Cases: no
payload check; "device checksum" (headers checked on the host, then per group: copy →
payload_checksum sums of every object on the device → compare with the headers → scatter,
the compare of group g overlapping the copy and checksum of group g + 1, as the prefill
worker does); "host checksum" (the same function on the host, in a thread pool, before
the copy: what a CPU engine does). Checked for exactness first, then timed. The wait is
measured from the first stage's start to the last stage's end (all stages at once).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvpool.object_format import (
    HEADER_BYTES,
    ObjectSpec,
    check_object,
    checksums_of_sums,
    payload_sums_t,
    stored_payload_checksum,
    write_header,
)
from protocol.ids import ChunkKey

CHUNK = 256
BLOCK = 16
GROUP = 8
"""Chunks per H2D copy: a restore moves many chunks at once, and fewer, larger copies and
scatters keep kernel launches (and the GIL, with one driving thread per stage) out of the
way."""


class Stage:
    """One GPU's share: pinned objects of its layers, its paged KV, its block table."""

    def __init__(self, s: int, args: argparse.Namespace, layers: range) -> None:
        self.dev = torch.device(f"cuda:{s}")
        self.dtype = getattr(torch, args.dtype)
        self.num_chunks = args.tokens // CHUNK
        self.spec = ObjectSpec(
            namespace_hash=b"\x01" * 16,
            stage=s,
            num_stages=args.stages,
            layer_start=layers.start,
            layer_end=layers.stop,
            num_tokens=CHUNK,
            dtype=args.dtype,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
        )
        self.obj_bytes = self.spec.object_bytes
        self.host = torch.empty(self.num_chunks * self.obj_bytes, dtype=torch.uint8).pin_memory()
        g = torch.Generator().manual_seed(s)
        payload_elems = self.spec.payload_bytes // torch.tensor([], dtype=self.dtype).element_size()
        flat = self.host.numpy()
        self.keys = [
            ChunkKey(bytes([c % 256, c // 256]) + b"\x00" * 14) for c in range(self.num_chunks)
        ]
        for c in range(self.num_chunks):
            o = c * self.obj_bytes
            src = torch.randn(payload_elems, generator=g).to(self.dtype)
            self.host[o + HEADER_BYTES : o + self.obj_bytes].view(self.dtype).copy_(src)
            write_header(flat[o : o + self.obj_bytes], self.spec, self.keys[c])
        L, H, D = len(layers), args.kv_heads, args.head_dim
        num_blocks = args.tokens // BLOCK
        self.kv = [
            torch.zeros(2, num_blocks, BLOCK, H, D, dtype=self.dtype, device=self.dev)
            for _ in range(L)
        ]
        perm = torch.randperm(num_blocks, generator=g)
        self.block_table = perm.to(self.dev)
        self.staging = [
            torch.empty(GROUP * self.obj_bytes, dtype=torch.uint8, device=self.dev)
            for _ in range(2)
        ]
        self.streams = [torch.cuda.Stream(self.dev) for _ in range(2)]
        self.hashers = cf.ThreadPoolExecutor(8)

    def _check(self, c: int, verify_payload: bool = True) -> str | None:
        o = c * self.obj_bytes
        return check_object(
            self.host.numpy()[o : o + self.obj_bytes],
            self.obj_bytes,
            self.spec,
            self.keys[c],
            verify_payload,
        )

    def restore(self, verify: str) -> None:
        """All chunks into the pages, GROUP chunks per H2D copy; raises if an object fails
        its check. verify: "none", "host" (before its group is copied) or "device" (after
        the copy, before the scatter)."""
        L = self.spec.layer_end - self.spec.layer_start
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        checks = (
            [self.hashers.submit(self._check, c) for c in range(self.num_chunks)]
            if verify == "host"
            else None
        )
        want: list[int] = []
        if verify == "device":  # headers on the host (128 B each), payloads on the device
            flat = self.host.numpy()
            for c in range(self.num_chunks):
                if (why := self._check(c, verify_payload=False)) is not None:
                    raise RuntimeError(f"chunk {c}: {why}")
                o = c * self.obj_bytes
                want.append(stored_payload_checksum(flat[o : o + self.obj_bytes]))
        bpc = CHUNK // BLOCK
        pending: tuple[int, int, int, torch.Tensor, torch.cuda.Event] | None = None

        def scatter(g: int, c0: int, n: int) -> None:
            i = g % 2
            with torch.cuda.stream(self.streams[i]):
                span = self.staging[i][: n * self.obj_bytes]
                # objects [n, header | payload [L, 2, 16 blocks, 16, H, D]] -> per layer
                # [2, n * 16 blocks, 16, H, D] into the pages of those blocks
                objs = span.view(n, self.obj_bytes)[:, HEADER_BYTES:]
                pay = objs.view(self.dtype).view(n, L, 2, bpc, BLOCK, H, D)
                ids = self.block_table[c0 * bpc : (c0 + n) * bpc]
                for layer in range(L):
                    src = pay[:, layer].transpose(0, 1).reshape(2, n * bpc, BLOCK, H, D)
                    self.kv[layer].index_copy_(1, ids, src)

        def settle() -> None:  # compare the pending group's sums, then scatter it
            assert pending is not None
            pg, pc0, pn, sums, done = pending
            done.synchronize()  # that group's copy and sums only
            got = checksums_of_sums(sums)
            for k, (a, b) in enumerate(zip(got, want[pc0 : pc0 + pn], strict=True)):
                if a != b:
                    raise RuntimeError(f"chunk {pc0 + k}: checksum")
            scatter(pg, pc0, pn)

        for g, c0 in enumerate(range(0, self.num_chunks, GROUP)):
            n = min(GROUP, self.num_chunks - c0)
            if checks is not None:
                for c in range(c0, c0 + n):
                    if (why := checks[c].result()) is not None:
                        raise RuntimeError(f"chunk {c}: {why}")
            i = g % 2
            with torch.cuda.stream(self.streams[i]):
                span = self.staging[i][: n * self.obj_bytes]
                span.copy_(
                    self.host[c0 * self.obj_bytes : (c0 + n) * self.obj_bytes], non_blocking=True
                )
                if verify == "device":
                    sums = payload_sums_t(span.view(n, self.obj_bytes)[:, HEADER_BYTES:])
                    done = torch.cuda.Event()
                    done.record()
            if verify != "device":
                scatter(g, c0, n)
                continue
            if pending is not None:
                settle()
            pending = (g, c0, n, sums, done)
        if pending is not None:
            settle()
        for s in self.streams:
            s.synchronize()

    def verify_pages(self) -> None:
        L = self.spec.layer_end - self.spec.layer_start
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        bpc = CHUNK // BLOCK
        for c in range(self.num_chunks):
            o = c * self.obj_bytes + HEADER_BYTES
            want = (
                self.host[o : o + self.spec.payload_bytes]
                .view(self.dtype)
                .view(L, 2, bpc, BLOCK, H, D)
            )
            ids = self.block_table[c * bpc : (c + 1) * bpc]
            for layer in range(L):
                got = self.kv[layer].index_select(1, ids).cpu()
                if not torch.equal(got, want[layer]):
                    raise AssertionError(f"stage {self.spec.stage} chunk {c} layer {layer} differs")

    def ceiling(self) -> None:
        """One plain pinned->device copy of the same bytes (the H2D ceiling)."""
        dst = torch.empty_like(self.host, device=self.dev)
        dst.copy_(self.host, non_blocking=True)
        torch.cuda.synchronize(self.dev)


def _run_all(stages: list[Stage], fn) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    """Run fn(stage) on every stage at once; (first start to last end, per-stage times)."""
    times = [0.0] * len(stages)
    barrier = threading.Barrier(len(stages))

    def work(i: int) -> tuple[float, float]:
        torch.cuda.set_device(stages[i].dev)
        barrier.wait()
        t0 = time.perf_counter()
        fn(stages[i])
        t1 = time.perf_counter()
        times[i] = t1 - t0
        return t0, t1

    with cf.ThreadPoolExecutor(len(stages)) as ex:
        spans = list(ex.map(work, range(len(stages))))
    return max(e for _, e in spans) - min(s for s, _ in spans), times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stages", type=int, default=torch.cuda.device_count())
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    per = args.layers // args.stages
    stages = [
        Stage(s, args, range(s * per, args.layers if s == args.stages - 1 else (s + 1) * per))
        for s in range(args.stages)
    ]
    for st in stages:
        st.restore(verify="host")
        st.verify_pages()
        for k in st.kv:
            k.zero_()
        st.restore(verify="device")
        st.verify_pages()
    # a flipped payload bit is caught by the device check
    st = stages[0]
    o = HEADER_BYTES + st.spec.payload_bytes // 2
    st.host[o] ^= 0x04
    try:
        st.restore(verify="device")
        raise AssertionError("the device checksum missed a flipped bit")
    except RuntimeError as e:
        assert "chunk 0: checksum" in str(e), e
    st.host[o] ^= 0x04
    print(
        f"check: {args.stages} stage(s) x {stages[0].num_chunks} chunks restored exactly, "
        f"checksums verified (host and device), a flipped bit caught on the device"
    )
    nbytes = [st.spec.payload_bytes * st.num_chunks for st in stages]
    rows = []
    for name, fn in (
        ("H2D ceiling (one pinned copy)", lambda st: st.ceiling()),
        ("restore, no payload checksum", lambda st: st.restore(verify="none")),
        ("restore + device checksum", lambda st: st.restore(verify="device")),
        ("restore + host checksum", lambda st: st.restore(verify="host")),
    ):
        best_wait, best_per = float("inf"), [float("inf")] * len(stages)
        for _ in range(args.reps):
            wait, per_stage = _run_all(stages, fn)
            best_wait = min(best_wait, wait)
            best_per = [min(a, b) for a, b in zip(best_per, per_stage, strict=True)]
        gbps = [b / t / 1e9 for b, t in zip(nbytes, best_per, strict=True)]
        rows.append((name, gbps, best_wait))
    ceil = rows[0][1]
    print(
        f"\n{args.tokens} tokens, {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} ({args.dtype}), {args.stages} stage(s), {nbytes[0] / 1e9:.2f} GB "
        f"per stage, best of {args.reps}"
    )
    print(f"{'case':<32}{'GB/s per stage':>28}{'% of ceiling':>16}{'first->last ms':>16}")
    for name, gbps, wait in rows:
        pct = " ".join(f"{g / c * 100:.0f}%" for g, c in zip(gbps, ceil, strict=True))
        print(f"{name:<32}{' '.join(f'{g:.1f}' for g in gbps):>28}{pct:>16}{wait * 1e3:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

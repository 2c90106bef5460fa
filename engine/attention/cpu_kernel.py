"""The CPU paged attention kernels, decode (cpu_decode.c) and prefill (cpu_prefill.c):
built into one library with the system C compiler, loaded with ctypes, called once per
layer per step.

The library is compiled once per (source, flags, CPU) into the user's cache
(~/.cache/kvserve, or $XDG_CACHE_HOME/kvserve) with -march=native, so each machine gets
code for its own vector units; a compile takes well under a second and happens the first
time an engine builds the "cpu" attention backend (start-up), never per request. Without
a compiler `load()` raises KernelUnavailable and the engine falls back to the reference
backend (engine/attention/cpu_paged.py says when).

Threads: the kernels are single-threaded; `decode` and `prefill` split a step over
torch's intra-op thread count (decode by sequence, and by key range when there are fewer
sequences than threads; prefill by units of 32 query rows of one KV head, interleaved)
with a small pool of Python threads (ctypes releases the GIL during the call), each job
with its own scratch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from engine.attention.base import merge_partials

log = logging.getLogger(__name__)

SOURCE_PATHS = [
    Path(__file__).with_name(n) for n in ("cpu_decode.c", "cpu_decode_avx512.c", "cpu_prefill.c")
]
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fassociative-math",
    "-shared",
    "-fPIC",
]
"""Reassociation (-fassociative-math and what it requires) lets the per-token dot products
vectorize; infinities and NaNs keep their meaning (lse of a row without keys is -inf).
Never -ffast-math: gcc then links crtfastmath.o into the library, whose constructor sets
flush-to-zero and denormals-are-zero in MXCSR when it is loaded, changing the float
arithmetic of the whole engine process (every subnormal becomes 0)."""

_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_void_p,  # k cache
    ctypes.c_void_p,  # v cache
    ctypes.c_void_p,  # block tables
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # seq lens
    ctypes.c_int64,  # Hq
    ctypes.c_int64,  # Hkv
    ctypes.c_int64,  # D
    ctypes.c_int64,  # block size
    ctypes.c_float,  # scale
    ctypes.c_int64,  # first sequence
    ctypes.c_int64,  # end sequence
    ctypes.c_void_p,  # scores scratch
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # lse
]

MIN_KEYS_PER_THREAD = 2048
"""Keys (summed over a thread's sequences) below which another thread costs more than it
saves (a pool hand-off is ~20 us, 2K keys of SmolLM2's 9 heads ~30 us of kernel)."""


_PREFILL_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_void_p,  # k cache
    ctypes.c_void_p,  # v cache
    ctypes.c_void_p,  # block tables
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # sequences [S, 4]: first query row, q_len, seq_len, table row
    ctypes.c_int64,  # S
    ctypes.c_int64,  # Hq
    ctypes.c_int64,  # Hkv
    ctypes.c_int64,  # D
    ctypes.c_int64,  # block size
    ctypes.c_float,  # scale
    ctypes.c_int64,  # job
    ctypes.c_int64,  # jobs
    ctypes.c_void_p,  # scratch
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # lse
]

MIN_PREFILL_WORK_PER_THREAD = 1 << 22
"""Multiply-adds (query rows x keys x head dim, summed over heads) below which another
prefill thread costs more than it saves (~30 us of kernel at ~140 GFLOP/s)."""

MAX_HEADS = 256
"""Query heads per sequence the decode kernel handles (its per-head running max and sum
sit on the stack); the backend uses the reference beyond."""

MAX_HEAD_DIM = 256
"""Head dims the prefill kernel handles (cpu_prefill.c's MAX_D)."""


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine (no C compiler, not Linux)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve"


def _cpu_signature() -> str:
    """The CPU's feature flags: -march=native code is only valid on the CPU it was built
    for, and a cache directory may be shared between machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return "unknown"


def _build() -> Path:
    if not sys.platform.startswith("linux"):
        raise KernelUnavailable("the CPU attention kernel is built on Linux only")
    sources = [p.read_text() for p in SOURCE_PATHS]
    key = "\0".join([*sources, *FLAGS, _cpu_signature()])
    lib = cache_dir() / f"cpu-decode-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or gcc) to build the CPU attention kernel")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *FLAGS, "-o", str(out), *map(str, SOURCE_PATHS), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise KernelUnavailable(
                f"building the CPU attention kernel failed: {res.stderr[-500:]}"
            )
        os.replace(out, lib)  # atomic: concurrent engines never load a partial file
    return lib


@cache
def load() -> ctypes.CDLL:
    """The loaded library (built on first use); raises KernelUnavailable."""
    lib = ctypes.CDLL(str(_build()))
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        fn = getattr(lib, name)
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    for name in ("paged_prefill_bf16", "paged_prefill_f32"):
        fn = getattr(lib, name)
        fn.argtypes = _PREFILL_ARGTYPES
        fn.restype = ctypes.c_int
    lib.prefill_scratch_floats.argtypes = [ctypes.c_int64]
    lib.prefill_scratch_floats.restype = ctypes.c_int64
    lib.prefill_rows_per_unit.argtypes = []
    lib.prefill_rows_per_unit.restype = ctypes.c_int64
    return lib


def available() -> bool:
    try:
        load()
    except (KernelUnavailable, OSError) as e:
        log.warning("CPU attention kernel unavailable: %s", e)
        return False
    return True


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="cpu-attn")


def _run_jobs(run: Callable[[int], int], jobs: int) -> list[int]:
    """run(j) for j < jobs at once: all but the last on the pool, the last on this thread
    (it would wait anyway)."""
    pending = [_pool(jobs - 1).submit(run, j) for j in range(jobs - 1)]
    return [run(jobs - 1), *(f.result() for f in pending)]


def decode(
    q: torch.Tensor,  # [B, Hq, D] float32 contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] bfloat16 or float32
    block_tables: torch.Tensor,  # [B, >= max blocks] int32, rows may be strided
    seq_lens: torch.Tensor,  # [B] int32 contiguous
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] float32, [B, Hq] float32
    """One query row per sequence over its first seq_lens[b] keys; out and lse.

    With T torch threads and enough keys, the step is split into jobs run at once: by
    sequence when B >= T; otherwise each sequence's keys are also cut into P = T // B
    block-aligned parts whose partial results merge by their LSE (base.merge_partials):

        B = 1, T = 2:   keys [0 ........ n/2 | n/2 ........ n)  -> 2 jobs, 1 merge
    """
    lib = load()
    fn = lib.paged_decode_bf16 if kv_cache.dtype == torch.bfloat16 else lib.paged_decode_f32
    assert kv_cache.dtype in (torch.bfloat16, torch.float32) and kv_cache.is_contiguous()
    assert q.dtype == torch.float32 and q.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    threads = max(1, min(torch.get_num_threads(), num_seqs * max_len // MIN_KEYS_PER_THREAD))
    num_blocks = max(1, -(-max_len // block_size))
    parts = max(1, min(threads // num_seqs, num_blocks))
    per_part = -(-num_blocks // parts)  # blocks per part
    parts = -(-num_blocks // per_part)
    if parts == 1:
        jobs = [(0, num_seqs * i // threads, num_seqs * (i + 1) // threads) for i in range(threads)]
        part_len, lens = max(max_len, 1), seq_lens.view(1, -1)
    else:
        jobs = [(p, b, b + 1) for p in range(parts) for b in range(num_seqs)]
        part_len = per_part * block_size
        starts = torch.arange(parts, dtype=torch.int32).view(-1, 1) * part_len
        lens = (seq_lens.view(1, -1) - starts).clamp(0, part_len).contiguous()  # [P, B]
    out = torch.empty(parts, num_seqs, num_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(parts, num_seqs, num_heads, dtype=torch.float32)
    # scratch per job: the portable kernel's scores, the AVX-512 one's permuted query
    scores = torch.empty(len(jobs), num_heads * max(part_len, head_dim), dtype=torch.float32)
    entry = block_tables.element_size()

    def run(j: int) -> int:
        p, first, end = jobs[j]
        return int(
            fn(
                q.data_ptr(),
                kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(),
                block_tables.data_ptr() + p * per_part * entry,  # part p's first block
                block_tables.stride(0),
                lens[p].data_ptr(),
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                scale,
                first,
                end,
                scores[j].data_ptr(),
                out[p].data_ptr(),
                lse[p].data_ptr(),
            )
        )

    if any(_run_jobs(run, len(jobs))):
        raise ValueError(
            f"CPU attention kernel: {num_heads} query heads over {num_kv_heads} KV heads"
        )
    if parts == 1:
        return out[0], lse[0]
    total = torch.logsumexp(lse, dim=0)  # [B, Hq]; -inf for a sequence without keys
    merged = merge_partials(out, torch.where(torch.isinf(total), 0.0, lse))
    return merged.masked_fill(torch.isinf(total).unsqueeze(-1), 0.0), total


def prefill(
    q: torch.Tensor,  # [T, Hq, D] float32 contiguous: the step's query rows
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] bfloat16 or float32
    block_tables: torch.Tensor,  # [B, >= max blocks] int32, rows may be strided
    seqs: torch.Tensor,  # [S, 4] int32 contiguous: first query row, q_len, seq_len, table row
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] float32 contiguous, written
    lse: torch.Tensor,  # [T, Hq] float32 contiguous, written
) -> None:
    """Causal attention of each listed sequence's q_len new rows (the last q_len of its
    seq_len keys, all already in the cache) over its keys, read in place: new token j
    sees keys 0 ..= seq_len - q_len + j. Writes those rows of `out` and `lse` (natural
    log) and no others.

    With T torch threads and enough work, the units (32 query rows of one KV head of one
    sequence with AVX-512, 16 with AVX2) are dealt out to min(T, units) jobs in turn, so
    each job gets early and late rows of a chunk (late rows see more keys)."""
    lib = load()
    fn = lib.paged_prefill_bf16 if kv_cache.dtype == torch.bfloat16 else lib.paged_prefill_f32
    assert kv_cache.dtype in (torch.bfloat16, torch.float32) and kv_cache.is_contiguous()
    assert q.dtype == torch.float32 and q.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seqs.dtype == torch.int32
    assert seqs.is_contiguous() and out.is_contiguous() and lse.is_contiguous()
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group, unit_rows = num_heads // max(num_kv_heads, 1), int(lib.prefill_rows_per_unit())
    units = work = 0
    for _, q_len, seq_len, _ in seqs.tolist():
        units += num_kv_heads * -(-q_len * group // unit_rows)
        work += q_len * seq_len * num_heads * head_dim
    if units == 0:
        return
    jobs = max(1, min(torch.get_num_threads(), units, work // MIN_PREFILL_WORK_PER_THREAD))
    scratch = torch.empty(jobs, int(lib.prefill_scratch_floats(head_dim)), dtype=torch.float32)

    def run(j: int) -> int:
        return int(
            fn(
                q.data_ptr(),
                kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(),
                block_tables.data_ptr(),
                block_tables.stride(0),
                seqs.data_ptr(),
                seqs.shape[0],
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                scale,
                j,
                jobs,
                scratch[j].data_ptr(),
                out.data_ptr(),
                lse.data_ptr(),
            )
        )

    if any(_run_jobs(run, jobs)):
        raise ValueError(
            f"CPU prefill kernel: {num_heads} query heads over {num_kv_heads} KV heads, "
            f"head dim {head_dim}"
        )

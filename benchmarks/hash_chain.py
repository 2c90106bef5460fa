"""Micro-benchmark of protocol.hashing.hash_chain on one long agentic prompt.

Checks first that hash_chain equals the reference (a per-block hash_block loop) and that
extending a chain from its middle gives the same hashes, then times both. Seeded tokens,
so every run hashes the same prompt.

    python -m benchmarks.hash_chain [--num-tokens 150000] [--block-size 16] [--runs 50]

DESIGN.md §4 target: well under 1 ms per 1K blocks.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from protocol.hashing import hash_block, hash_chain, namespace_seed
from protocol.ids import BlockHash


def reference_chain(tokens: np.ndarray, block_size: int, root: BlockHash) -> list[BlockHash]:
    """The definition, one hash_block call per full block."""
    out: list[BlockHash] = []
    parent = root
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_s(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=150_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, args.vocab_size, size=args.num_tokens, dtype=np.int64)
    token_list = tokens.tolist()
    root = namespace_seed("bench/hash_chain")
    block_size = args.block_size
    num_blocks = args.num_tokens // block_size

    chain = hash_chain(tokens, block_size, root)
    if chain != reference_chain(tokens, block_size, root):
        raise SystemExit("FAIL: hash_chain differs from the per-block reference")
    if hash_chain(token_list, block_size, root) != chain:
        raise SystemExit("FAIL: hash_chain of a list differs from hash_chain of an array")
    half = num_blocks // 2
    tail = hash_chain(tokens, block_size, root, start_block=half, parent=chain[half - 1])
    if chain[:half] + tail != chain:
        raise SystemExit("FAIL: extending the chain from its middle differs from the full chain")
    print(f"correct: {num_blocks} block hashes equal the reference and the extended chain")

    cases: list[tuple[str, Callable[[], object]]] = [
        ("hash_chain(np.ndarray)", lambda: hash_chain(tokens, block_size, root)),
        ("hash_chain(list[int])", lambda: hash_chain(token_list, block_size, root)),
        ("reference hash_block loop", lambda: reference_chain(tokens, block_size, root)),
    ]
    print(
        f"\n{args.num_tokens} tokens, block {block_size} -> {num_blocks} blocks; "
        f"median of {args.runs} runs; {cpu_name()}, "
        f"Python {platform.python_version()}"
    )
    print(f"{'case':<28} {'total ms':>9} {'us / 1K blocks':>15} {'Mtokens/s':>10}")
    for name, fn in cases:
        t = median_s(fn, args.runs)
        per_1k_us = t / num_blocks * 1000 * 1e6
        print(f"{name:<28} {t * 1e3:>9.3f} {per_1k_us:>15.1f} {args.num_tokens / t / 1e6:>10.1f}")


if __name__ == "__main__":
    main()

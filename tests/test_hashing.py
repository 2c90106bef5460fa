"""protocol.hashing: the one hash chain shared by router, prefix cache and pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from protocol.hashing import HASH_BYTES, chunk_keys, hash_block, hash_chain, namespace_seed

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16

_CHAIN_SCRIPT = """
import numpy as np
from protocol.hashing import hash_chain, namespace_seed
tokens = np.random.default_rng(7).integers(0, 50_000, size=1000)
print(",".join(h.hex() for h in hash_chain(tokens, 16, namespace_seed("model-a/bf16/16"))))
"""


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def test_chain_equals_per_block_definition() -> None:
    tokens = _tokens(16 * 10 + 5)
    root = namespace_seed("ns")
    chain = hash_chain(tokens, BLOCK, root)
    assert len(chain) == 10  # the trailing partial block has no hash
    parent = root
    for i, h in enumerate(chain):
        parent = hash_block(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        assert h == parent and len(h) == HASH_BYTES


def test_deterministic_across_processes() -> None:
    tokens = np.random.default_rng(7).integers(0, 50_000, size=1000)
    expected = ",".join(h.hex() for h in hash_chain(tokens, 16, namespace_seed("model-a/bf16/16")))
    for hash_seed in ("1", "12345"):  # Python's own str hash seed must not matter
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO_ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", _CHAIN_SCRIPT],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == expected


def test_namespace_changes_every_hash() -> None:
    tokens = _tokens(16 * 20)
    a = hash_chain(tokens, BLOCK, namespace_seed("model-a/fp8/16"))
    b = hash_chain(tokens, BLOCK, namespace_seed("model-a/bf16/16"))
    assert namespace_seed("model-a/fp8/16") != namespace_seed("model-a/bf16/16")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    tokens = _tokens(16 * 8)
    changed = list(tokens)
    changed[16 * 3 + 5] += 1
    root = namespace_seed("ns")
    a, b = hash_chain(tokens, BLOCK, root), hash_chain(changed, BLOCK, root)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_extension_from_start_block_equals_full_chain() -> None:
    tokens = _tokens(16 * 40 + 3)
    root = namespace_seed("ns")
    full = hash_chain(tokens, BLOCK, root)
    for start in (0, 1, 17, 39, 40):
        parent = root if start == 0 else full[start - 1]
        tail = hash_chain(tokens, BLOCK, root, start_block=start, parent=parent)
        assert full[:start] + tail == full
    # Extending a prefix's chain with more tokens gives the longer prompt's chain.
    prefix = hash_chain(tokens[: 16 * 10], BLOCK, root)
    more = hash_chain(tokens, BLOCK, root, start_block=10, parent=prefix[-1])
    assert prefix + more == full


def test_list_and_array_inputs_agree() -> None:
    tokens = _tokens(16 * 5)
    root = namespace_seed("ns")
    assert hash_chain(tokens, BLOCK, root) == hash_chain(np.array(tokens), BLOCK, root)


def test_chunk_keys_pick_every_16th_block_hash() -> None:
    tokens = _tokens(256 * 3 + 16 * 5)  # 3 full chunks and 5 blocks of a 4th
    chain = hash_chain(tokens, BLOCK, namespace_seed("ns"))
    assert len(chain) == 16 * 3 + 5
    keys = chunk_keys(chain, 16)
    assert keys == [chain[15], chain[31], chain[47]]
    assert chunk_keys(chain[:15], 16) == []

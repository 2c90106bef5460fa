"""Injected pool faults for end-to-end tests of the recompute path (never set in service).

    KVSERVE_POOL_FAULT_DIR=<dir>      (a prefill instance's `env` in cluster.yaml)
    <dir>/load-stage<N>               arms one fault: the next read of stage N's objects
                                      by any client on this host brings back only its
                                      first object; the others fail with reason
                                      "injected", as a store dying mid-read would

A fault is taken by removing its file, so exactly one read (of one process) takes it.
Without the variable nothing is checked beyond one environment lookup per read.
"""

from __future__ import annotations

import os

FAULT_DIR_ENV = "KVSERVE_POOL_FAULT_DIR"


def take(op: str, stage: int) -> bool:
    """True (once per armed file) when a fault for `op` on `stage` is armed."""
    d = os.environ.get(FAULT_DIR_ENV)
    if not d:
        return False
    try:
        os.remove(os.path.join(d, f"{op}-stage{stage}"))
    except FileNotFoundError:
        return False
    return True

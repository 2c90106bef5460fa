"""`kvserve ... | head -1`: a command whose stdout reader has gone away stops quietly with
a closed pipe's status (128 + SIGPIPE), like a Unix tool, instead of a BrokenPipeError
traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "deploy" / "examples" / "local.yaml"


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run `python -m kvserve.cli ARGS` with stdout a pipe whose read end is already
    closed, so its first write of stdout fails (no race with a reader's exit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvserve.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [
        ("check", "-c", str(LOCAL)),
        ("render", "prometheus", "-c", str(LOCAL)),
    ],
    ids=["check", "render"],
)
def test_closed_stdout_exits_quietly(args: tuple[str, ...]) -> None:
    done = _run_into_closed_pipe(*args)
    assert done.stderr.decode() == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_open_stdout_still_prints_everything() -> None:
    """The same commands into a reader that stays: full output, status 0."""
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "check", "-c", str(LOCAL)],
        capture_output=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().startswith("cluster 'local' is valid")
    assert len(done.stdout.decode().splitlines()) > 1

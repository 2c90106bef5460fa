"""Starting components in their own process group, and stopping whole groups.

Each component runs as the leader of a new session/process group (pgid == its pid), so
one signal to the group reaches every process it spawned (stage and rank processes,
compilers, ...). Stopping is SIGTERM to the group, a grace period, then SIGKILL.

A pid from a state file may have been reused by an unrelated process since; the kernel's
start time of the process (/proc/<pid>/stat) is recorded with the pid and checked before
any signal is sent. Zombies do not count as alive: they hold no resources and in a
container without an init they may never be reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0]); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks since boot; None if it does not exist."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, started at `start_time`."""
    fields = _proc_stat(pid)
    if fields is None:
        if not Path("/proc").is_dir():  # no procfs: the best a signal 0 can tell
            try:
                os.kill(pid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        return False
    if fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _proc_stat(int(entry))
        if fields and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to every process of the group; a vanished group is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _set_parent_death_signal() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def spawn_group(
    argv: Sequence[str], env: dict[str, str], log: IO[bytes], cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` as the leader of a new process group, stdout+stderr into `log`."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
        close_fds=True,
        preexec_fn=_set_parent_death_signal,  # safe: the launcher runs no threads
    )


def stop_groups(
    pgids: Iterable[int],
    grace_s: float,
    reap: Iterable[subprocess.Popen[bytes]] = (),
    force_now: object = None,
) -> list[int]:
    """SIGTERM every group, wait up to `grace_s` for all to exit, SIGKILL the rest.

    `reap`: our own children among the leaders, polled so they do not linger as zombies.
    `force_now`: an object with a truthy `.force` attribute once the user asks to hurry
    (a second Ctrl-C); the wait is cut short. Returns the groups that needed SIGKILL.
    """
    pending = list(dict.fromkeys(pgids))
    children = list(reap)
    for pgid in pending:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        for child in children:
            child.poll()
        pending = [g for g in pending if group_members(g)]
        hurry = bool(getattr(force_now, "force", False))
        if not pending or time.monotonic() >= deadline or hurry:
            break
        time.sleep(0.05)
    killed = list(pending)
    for pgid in killed:
        signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while killed and time.monotonic() < deadline:
        for child in children:
            child.poll()
        if not any(group_members(g) for g in killed):
            break
        time.sleep(0.02)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)
    return killed

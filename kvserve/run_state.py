"""The run directory of a cluster on this host and its state file.

    <state dir>/<cluster name>/
        state.json        launcher pid, components (pid, port, log), phase; removed on stop
        launcher.lock     flock held by the running launcher: one launcher per cluster
        launcher.log      the detached launcher's own output
        logs/<name>.log   one log per component (the previous run's in logs.prev/)

`kvserve down` and `kvserve status` find a cluster through this file, from any shell.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

STATE_VERSION = 1

Phase = Literal["starting", "running", "stopping", "failed"]


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/kvserve, else ~/.local/state/kvserve."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvserve"


class ComponentState(msgspec.Struct, frozen=True, kw_only=True):
    """One started component: enough to probe it and to stop its process group."""

    name: str
    kind: str
    node: str
    host: str
    port: int
    pid: int
    """Process id, also the process group id (each component leads its own group)."""
    start_time: int | None
    """Kernel start time of pid (clock ticks since boot): guards against pid reuse."""
    log: str
    health_url: str
    status_url: str | None


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    """What a launcher started; written on every change, removed on a clean stop."""

    version: int = STATE_VERSION
    cluster: str
    config: str
    launcher_pid: int
    launcher_start_time: int | None
    started_at: float
    """Unix time the launch began."""
    phase: Phase
    endpoint: str | None
    components: tuple[ComponentState, ...] = ()


class RunDir:
    """Paths of one cluster's run directory under a state dir."""

    def __init__(self, state_dir: str | Path | None, cluster_name: str) -> None:
        base = Path(state_dir).expanduser() if state_dir else default_state_dir()
        self.root = base / cluster_name
        self.state_file = self.root / "state.json"
        self.lock_file = self.root / "launcher.lock"
        self.launcher_log = self.root / "launcher.log"
        self.logs = self.root / "logs"

    def log_of(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def read(self) -> RunState | None:
        """The state file, None if absent or unreadable (a torn write counts as absent)."""
        try:
            return msgspec.json.decode(self.state_file.read_bytes(), type=RunState)
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def write(self, state: RunState) -> None:
        """Atomic replace, so a reader never sees half a file."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
        tmp.replace(self.state_file)

    def remove(self) -> None:
        self.state_file.unlink(missing_ok=True)

    def rotate_logs(self) -> None:
        """Keep the previous run's logs in logs.prev/, start with an empty logs/."""
        prev = self.root / "logs.prev"
        if self.logs.exists():
            if prev.exists():
                for f in prev.iterdir():
                    f.unlink()
                prev.rmdir()
            self.logs.rename(prev)
        self.logs.mkdir(parents=True, exist_ok=True)

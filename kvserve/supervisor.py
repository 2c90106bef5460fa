"""The supervisor of one `kvserve up`: start stages, wait for health, watch, stop.

    start stage 1 ─ wait /health ─ start stage 2 ─ wait /health ─ ready ─ watch ─┐
          │ a component exits / times out / signal                               │
          └──────────────────────────▶ stop every group (TERM, grace, KILL) ◀────┘
                                       (the pool's master last)

Any component that exits, or is not healthy in time, stops the whole launch: a cluster
with a hole in it is worse than no cluster. Once the cluster runs, the pool's processes
and the workers (spec.restart) are started again when they exit, after a back-off (1 s,
doubling to 30 s while they keep dying young); serving goes on meanwhile (the router
routes around a dead worker, prefill recomputes without the pool). The router is not
restarted: without it there is nothing to serve.
The state file mirrors what is running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import msgspec

from kvserve.components import ComponentSpec
from kvserve.health import http_get, unseen_by_router
from kvserve.process_groups import process_start_time, spawn_group, stop_groups
from kvserve.run_state import ComponentState, Phase, RunDir, RunState
from protocol.errors import KvserveError

LOG_TAIL_LINES = 40
_POLL_S = 0.2
_START_POLL_S = 0.05
"""Health probes of a starting stage (loopback or LAN GETs; the stage is ready sooner)."""
RESTART_FIRST_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
RESTART_STABLE_S = 60.0
"""A restarted component that ran this long starts over at the first delay."""
STOPPED_LAST = ("pool_master",)
"""Kinds stopped once every other component has exited: the pool's stores and the workers
that mounted pool segments unmount them through the master, and a store whose master
stopped first can block in Mooncake's unmount until it is killed."""
LAST_MIN_GRACE_S = 1.0


class LaunchError(KvserveError):
    """The cluster could not be started (a component failed, a port is busy, ...)."""


def stop_in_order(
    groups: Sequence[tuple[str, int]],
    grace_s: float,
    reap: Mapping[int, subprocess.Popen[bytes]] | None = None,
    force_now: object = None,
) -> dict[int, float]:
    """Stop components' process groups, given as (kind, pgid) in start order; the one stop
    order of the launcher (`Supervisor`, and `kvserve down` when the launcher is gone).

    Every group but the STOPPED_LAST kinds at once, signalled in reverse start order (the
    router first: no new request reaches a worker being stopped); then the STOPPED_LAST
    ones, once the others have exited, with what is left of `grace_s` (at least
    LAST_MIN_GRACE_S). `reap`: our own children by pgid (see `stop_groups`). Returns the
    groups that needed SIGKILL, each with the grace it was given.
    """
    deadline = time.monotonic() + grace_s
    ordered = list(reversed(groups))
    killed: dict[int, float] = {}
    for wave in (
        [pgid for kind, pgid in ordered if kind not in STOPPED_LAST],
        [pgid for kind, pgid in ordered if kind in STOPPED_LAST],
    ):
        if not wave:
            continue
        wave_grace_s = max(deadline - time.monotonic(), LAST_MIN_GRACE_S)
        children = [reap[g] for g in wave if reap and g in reap]
        for pgid in stop_groups(wave, wave_grace_s, reap=children, force_now=force_now):
            killed[pgid] = wave_grace_s
    return killed


def log_tail(path: os.PathLike[str] | str, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log file ("" if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except FileNotFoundError:
        return ""
    lines = data.decode(errors="replace").splitlines()[-num_lines:]
    return "\n".join(lines)


@dataclass
class _Running:
    spec: ComponentSpec
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    state: ComponentState
    started_s: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    """When an exited restartable component is started again (None: running)."""
    restart_delay_s: float = RESTART_FIRST_DELAY_S


@dataclass
class _Signals:
    """Set by signal handlers, read by the loops: the first signal stops, a second hurries."""

    stop: int | None = None
    force: bool = False
    previous: dict[int, object] = field(default_factory=dict)

    def handle(self, signum: int, _frame: object) -> None:
        if self.stop is None:
            self.stop = signum
        else:
            self.force = True


class _Stopped(Exception):
    """A stop signal arrived while starting."""


class Supervisor:
    """Owns the component processes of one launch, its state file and its signals."""

    def __init__(
        self,
        run: RunDir,
        stages: list[list[ComponentSpec]],
        *,
        cluster_name: str,
        config_path: str,
        endpoint: str | None,
        health_timeout_s: float,
        stop_grace_s: float,
        out: IO[str],
    ) -> None:
        self.run = run
        self.stages = stages
        self.health_timeout_s = health_timeout_s
        self.stop_grace_s = stop_grace_s
        self.out = out
        self.endpoint = endpoint
        self.running: list[_Running] = []
        self.signals = _Signals()
        self.cluster_name = cluster_name
        self.config_path = config_path
        self.started_at = time.time()
        self.launcher_pid = os.getpid()

    def say(self, msg: str) -> None:
        print(f"[kvserve] {msg}", file=self.out, flush=True)

    def serve(self, on_ready: Callable[[str | None], None]) -> int:
        """Start, report readiness (None) or the failure (its message) through `on_ready`,
        then watch until a signal (exit 0) or a component exit (exit 1). Runs in the
        process that owns the children (the background one with --detach)."""
        self.launcher_pid = os.getpid()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.signals.previous[signum] = signal.signal(signum, self.signals.handle)
        try:
            try:
                for stage in self.stages:
                    self._start_stage(stage)
                    self._wait_healthy(stage)
            except LaunchError as e:
                self.say(f"launch failed: {e}")
                self._stop_all()
                on_ready(str(e))
                return 1
            except _Stopped:
                self.say(f"stopping before ready ({signal.Signals(self.signals.stop or 15).name})")
                self._stop_all()
                on_ready("stopped by a signal before the cluster was ready")
                return 130
            self._write("running")
            on_ready(None)
            return self._watch()
        finally:
            for restored, handler in self.signals.previous.items():
                signal.signal(restored, handler)  # type: ignore[arg-type]
            for r in self.running:
                r.log.close()

    # -- stages ---------------------------------------------------------------------------

    def _start_stage(self, stage: list[ComponentSpec]) -> None:
        for spec in stage:
            log_path = self.run.log_of(spec.name)
            log = open(log_path, "ab")  # noqa: SIM115 (lives as long as the process)
            try:
                proc = self._spawn(spec, log)
            except OSError as e:
                log.close()
                raise LaunchError(f"{spec.name}: cannot start {spec.argv[0]!r}: {e}") from None
            state = ComponentState(
                name=spec.name,
                kind=spec.kind,
                node=spec.node,
                host=spec.host,
                port=spec.port,
                pid=proc.pid,
                start_time=process_start_time(proc.pid),
                log=str(log_path),
                health_url=spec.health_url,
                status_url=spec.status_url,
            )
            self.running.append(_Running(spec, proc, log, state))
            self.say(f"started {spec.name} ({spec.kind}, pid {proc.pid}) on {spec.base_url}")
        self._write("starting")

    def _spawn(self, spec: ComponentSpec, log: IO[bytes]) -> subprocess.Popen[bytes]:
        header = f"[kvserve] {time.strftime('%F %T')} starting: {' '.join(spec.argv)}\n"
        log.write(header.encode())
        log.flush()
        return spawn_group(spec.argv, {**os.environ, **spec.env}, log)

    def _restart_later(self, r: _Running, rc: int) -> None:
        """A restartable component exited: schedule its restart (back-off)."""
        if time.monotonic() - r.started_s > RESTART_STABLE_S:
            r.restart_delay_s = RESTART_FIRST_DELAY_S
        r.restart_at = time.monotonic() + r.restart_delay_s
        self.say(
            f"{r.spec.name} exited with code {rc}; restarting it in {r.restart_delay_s:g}s "
            f"(log {r.state.log})"
        )
        r.restart_delay_s = min(r.restart_delay_s * 2, RESTART_MAX_DELAY_S)

    def _restart_now(self, r: _Running) -> None:
        try:
            r.proc = self._spawn(r.spec, r.log)
        except OSError as e:
            self.say(f"{r.spec.name}: cannot restart: {e}; trying again later")
            r.restart_at = time.monotonic() + r.restart_delay_s
            return
        r.restart_at = None
        r.started_s = time.monotonic()
        r.state = msgspec.structs.replace(
            r.state, pid=r.proc.pid, start_time=process_start_time(r.proc.pid)
        )
        self.say(f"restarted {r.spec.name} (pid {r.proc.pid})")
        self._write("running")

    def _wait_healthy(self, stage: list[ComponentSpec]) -> None:
        t0 = time.monotonic()
        pending = [r for r in self.running if r.spec in stage]
        while pending:
            if self.signals.stop is not None:
                raise _Stopped
            for r in list(pending):
                rc = r.proc.poll()
                if rc is not None:
                    raise LaunchError(self._failure(r, f"exited with code {rc} while starting"))
                probe = http_get(r.spec.health_url, timeout_s=1.0)
                if probe.ok and not unseen_by_router(probe.body, r.spec.waits_for):
                    pending.remove(r)
                    self.say(f"{r.spec.name} is healthy ({time.monotonic() - t0:.1f}s)")
            if pending and time.monotonic() - t0 > self.health_timeout_s:
                r = pending[0]
                probe = http_get(r.spec.health_url, timeout_s=1.0)
                why = f"HTTP {probe.status} {probe.error}" if probe.status else probe.error
                unseen = unseen_by_router(probe.body, r.spec.waits_for) if probe.ok else []
                if unseen:
                    why = f"it does not see {', '.join(unseen)} healthy yet"
                raise LaunchError(
                    self._failure(
                        r,
                        f"not healthy after {self.health_timeout_s:g}s "
                        f"(GET {r.spec.health_url}: {why})",
                    )
                )
            if pending:
                time.sleep(_START_POLL_S)

    def _watch(self) -> int:
        while self.signals.stop is None:
            for r in self.running:
                if r.restart_at is not None:
                    if time.monotonic() >= r.restart_at:
                        self._restart_now(r)
                    continue
                rc = r.proc.poll()
                if rc is None:
                    continue
                if r.spec.restart:
                    self._restart_later(r, rc)
                    continue
                self.say(self._failure(r, f"exited with code {rc}; stopping the cluster"))
                self._stop_all()
                return 1
            time.sleep(_POLL_S)
        self.say(f"{signal.Signals(self.signals.stop).name}: stopping the cluster")
        self._stop_all()
        self.say("stopped")
        return 0

    # -- stopping and bookkeeping --------------------------------------------------------

    def _stop_all(self) -> None:
        if not self.running:
            self.run.remove()
            return
        self._write("stopping")
        killed = stop_in_order(
            [(r.spec.kind, r.proc.pid) for r in self.running],
            self.stop_grace_s,
            reap={r.proc.pid: r.proc for r in self.running},
            force_now=self.signals,
        )
        for r in self.running:
            if r.proc.pid in killed:
                self.say(f"{r.spec.name} ignored SIGTERM for {killed[r.proc.pid]:.3g}s: killed")
        self.run.remove()

    def _failure(self, r: _Running, what: str) -> str:
        tail = log_tail(r.state.log)
        body = "\n".join(f"    {line}" for line in tail.splitlines()) or "    (empty)"
        return f"{r.spec.name} {what}\n  log {r.state.log} (last lines):\n{body}"

    def _write(self, phase: Phase) -> None:
        state = RunState(
            cluster=self.cluster_name,
            config=self.config_path,
            launcher_pid=self.launcher_pid,
            launcher_start_time=process_start_time(self.launcher_pid),
            started_at=self.started_at,
            phase=phase,
            endpoint=self.endpoint,
            components=tuple(r.state for r in self.running),
        )
        self.run.write(state)

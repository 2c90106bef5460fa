"""Several router processes on one port (`router.processes` > 1).

    python -m router -c cluster.yaml                    process 0: starts the others,
      ├─ ... --process-index 1 --parent-pid P           serves, restarts one that exits
      └─ ... --process-index N-1 --parent-pid P

Each process is a whole router (its own event loop, worker connections, health and KV
watchers, ClusterView and metrics) bound to the same port with SO_REUSEPORT
(router/server.py `shared_listener`): the kernel hands each new connection to one of
them, and it stays there. What they do not share:

- the admission budget: each admits against 1/N of every decode instance's budget
  (`RouterSettings.process_admission_headroom`), so together they never reserve more
  than one gate would; the cost is fragmentation (a request larger than 1/N of the
  budget is refused with 400, and one process may make a request wait while another
  has room);
- the load view: each sees the reservations and outstanding prompts it sent itself,
  and the workers' own pushed load, which all of them read;
- /metrics: process i serves its own on `metrics_port + i` (the Prometheus config of
  `kvserve render prometheus` lists each); /metrics on the API port answers for
  whichever process took the connection.

Process 0 is the one the launcher starts and watches: when it ends the others are
stopped (SIGTERM from `stop`, or from the kernel when it dies: PR_SET_PDEATHSIG, set by
each child itself, `die_with_parent`). Another process that exits is logged and started
again after a back-off (1 s, doubling to 30 s while it keeps dying young); meanwhile
the kernel sends new connections to the ones still listening.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

RESTART_FIRST_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
RESTART_STABLE_S = 60.0
"""A process that ran this long is restarted after the first delay again."""
STOP_GRACE_S = 10.0
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In process i > 0: ask the kernel for SIGTERM when the process that started it
    ends (even by SIGKILL); exit at once if it has already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)


class _Sibling:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self.restart_at: float | None = None
        self.delay_s = RESTART_FIRST_DELAY_S


class RouterProcesses:
    """Owns router processes 1..N-1 of process 0: starts them, restarts one that exits,
    stops them all in `stop`. `argv_of(i)` is process i's command line. The watching
    runs on a thread of its own (process 0's main thread serves); the child processes
    are started from that thread only, which lives as long as process 0, so that their
    parent-death signal fires when process 0 ends and not before."""

    def __init__(self, argv_of: Callable[[int], Sequence[str]], num_processes: int) -> None:
        self._argv_of = argv_of
        self._siblings = [_Sibling(i) for i in range(1, num_processes)]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="router-processes", daemon=True)
        self._server_stopping: Callable[[], bool] = lambda: False

    def watch_server(self, server: Any) -> None:
        """Process 0's uvicorn Server: once it was told to stop (SIGTERM, SIGINT: a
        `kvserve down` signals the whole process group), an exiting process is not
        started again."""
        self._server_stopping = lambda: bool(server.should_exit)

    def start(self) -> None:
        self._thread.start()

    def pids(self) -> dict[int, int | None]:
        """Process index -> pid of the running process (None while it waits to restart)."""
        return {
            s.index: s.proc.pid if s.proc is not None and s.proc.poll() is None else None
            for s in self._siblings
        }

    def stop(self) -> None:
        """SIGTERM every process, wait up to STOP_GRACE_S, SIGKILL the rest."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        procs = [s.proc for s in self._siblings if s.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _spawn(self, s: _Sibling) -> None:
        s.proc = subprocess.Popen(list(self._argv_of(s.index)), stdin=subprocess.DEVNULL)
        s.started_s = time.monotonic()
        s.restart_at = None

    def _watch(self) -> None:
        for s in self._siblings:
            self._spawn(s)
        while not self._stopping.wait(_POLL_S):
            if self._server_stopping():
                continue
            now = time.monotonic()
            for s in self._siblings:
                if s.restart_at is not None:
                    if now >= s.restart_at:
                        log.info("starting router process %d again", s.index)
                        self._spawn(s)
                    continue
                assert s.proc is not None
                code = s.proc.poll()
                if code is None:
                    continue
                if now - s.started_s >= RESTART_STABLE_S:
                    s.delay_s = RESTART_FIRST_DELAY_S
                how = f"signal {-code}" if code < 0 else f"code {code}"
                log.warning(
                    "router process %d (pid %d) exited with %s; starting it again in %g s "
                    "(the other processes serve meanwhile)",
                    s.index,
                    s.proc.pid,
                    how,
                    s.delay_s,
                )
                s.restart_at = now + s.delay_s
                s.delay_s = min(RESTART_MAX_DELAY_S, s.delay_s * 2)

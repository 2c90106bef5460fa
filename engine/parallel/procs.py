"""The rank / stage processes an instance's driver starts, and their lifetime rules.

driver (rank 0, started by the launcher in its own process group)
  ├── rank 1   python -m decode_worker.ranks ...   same process group: `kvserve down`
  ├── rank 2   ...                                  stops them with the driver
  └── ...      each dies with the driver (PR_SET_PDEATHSIG), and the driver exits
               when one of them dies (a watchdog thread): an instance lives or dies
               whole, and the supervisor sees it.

A child that dies (SIGKILL, a crash, the OOM killer) is noticed within WATCH_INTERVAL_S
(its exit, not torch.distributed's timeouts, which are minutes). The driver then calls
`on_lost` (the worker fails its in-flight requests with a 503 and its /health answers
503), gives those answers LOST_GRACE_S to leave, stops the other children and exits 1;
the supervisor of `kvserve up` restarts the whole instance. A step whose collective broke
because a peer died asks `probe` first, so its requests fail as "instance lost" too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_RENDEZVOUS_PREFIX = "kvserve-dist-"
STOP_GRACE_S = 5.0
"""A child stopped by SIGTERM ends the instance only if the driver is not stopping by then."""
WATCH_INTERVAL_S = 0.2
"""How often the driver looks at its children."""
LOST_GRACE_S = 1.0
"""Between `on_lost` and the driver's exit: the error answers reach their clients."""


def die_with_parent(parent_pid: int) -> None:
    """Call first thing in a child: SIGTERM when the driver dies (Linux), and exit now if
    it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("cannot ask to die with the parent process on this platform")
    if os.getppid() != parent_pid:
        os._exit(1)


def rendezvous(master_addr: str | None, dist_port: int | None) -> str:
    """init_method for torch.distributed: tcp://addr:port with a configured port, else a
    FileStore in a fresh temporary directory (nothing listens)."""
    if dist_port is not None:
        return f"tcp://{master_addr or '127.0.0.1'}:{dist_port}"
    return f"file://{tempfile.mkdtemp(prefix=_RENDEZVOUS_PREFIX)}/store"


def remove_rendezvous(init_method: str) -> None:
    """Delete the FileStore directory `rendezvous` made (when the instance stops: NCCL
    may still use the store after start, to set up communicators lazily)."""
    path = init_method.removeprefix("file://")
    folder = os.path.dirname(path)
    if path != init_method and os.path.basename(folder).startswith(_RENDEZVOUS_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


class ChildProcesses:
    """Owns the processes a driver started; watches them until `stop`."""

    def __init__(self, argvs: list[list[str]], what: str, init_method: str = "") -> None:
        self.what = what
        self.init_method = init_method
        self.procs = [subprocess.Popen(argv) for argv in argvs]
        self.on_lost: Callable[[str], None] | None = None
        """Called (watch thread) with the reason when a child died: the worker fails
        its requests and reports unhealthy before the driver exits."""
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_loop, name="child-watch", daemon=True)
        self._watch.start()

    def dead(self) -> str | None:
        """Why the instance is lost (a child exited), or None while every child runs."""
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and code != -signal.SIGTERM:
                return _lost(self.what, i, p.pid, code)
        return None

    def probe(self, wait_s: float = 1.0) -> str | None:
        """`dead()`, waiting up to wait_s for a child to be seen gone (a collective can
        fail on the broken connection a moment before the dead child is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            why = self.dead()
            if why is not None or time.monotonic() >= deadline:
                return why
            time.sleep(0.02)

    def _watch_loop(self) -> None:
        while not self._stopping:
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code == -signal.SIGTERM:
                    # `kvserve down` signals the whole process group: this process is
                    # stopping too; give its own shutdown the time to begin.
                    time.sleep(STOP_GRACE_S)
                if code is not None and not self._stopping:
                    why = _lost(self.what, i, p.pid, code)
                    log.error("%s: stopping it", why)
                    self._lost(why)
                    self.stop(timeout_s=2.0)
                    os._exit(1)
            time.sleep(WATCH_INTERVAL_S)

    def _lost(self, why: str) -> None:
        if self.on_lost is None:
            return
        try:
            self.on_lost(why)
        except Exception:  # the exit below must happen whatever the worker does
            log.exception("failing the requests of a lost instance")
        time.sleep(LOST_GRACE_S)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child, SIGKILL what is left after timeout_s (idempotent)."""
        self._stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        remove_rendezvous(self.init_method)


def _lost(what: str, index: int, pid: int, code: int) -> str:
    return f"the instance lost a process: {what} {index + 1} (pid {pid}) exited with code {code}"

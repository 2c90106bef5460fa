"""The rank / stage processes an instance's driver starts, and their lifetime rules.

driver (rank 0, started by the launcher in its own process group)
  ├── rank 1   python -m decode_worker.ranks ...   same process group: `kvserve down`
  ├── rank 2   ...                                  stops them with the driver
  └── ...      each dies with the driver (PR_SET_PDEATHSIG), and the driver exits
               when one of them dies (a watchdog thread): an instance lives or dies
               whole, and the supervisor sees it.
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

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_RENDEZVOUS_PREFIX = "kvserve-dist-"
STOP_GRACE_S = 5.0
"""A child stopped by SIGTERM ends the instance only if the driver is not stopping by then."""


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
        self._stopping = False
        self._watch = threading.Thread(target=self._watch_loop, name="child-watch", daemon=True)
        self._watch.start()

    def _watch_loop(self) -> None:
        while not self._stopping:
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code == -signal.SIGTERM:
                    # `kvserve down` signals the whole process group: this process is
                    # stopping too; give its own shutdown the time to begin.
                    time.sleep(STOP_GRACE_S)
                if code is not None and not self._stopping:
                    log.error(
                        "%s %d (pid %d) exited with code %s: stopping the instance",
                        self.what,
                        i + 1,
                        p.pid,
                        code,
                    )
                    self.stop(timeout_s=2.0)
                    os._exit(1)
            time.sleep(0.5)

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

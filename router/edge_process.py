"""The kvserve-edge process of a router (router/edge.py): started, waited for until it
says it listens, started again with a back-off when it exits, stopped on request.

It lives on the router's event loop, in the main thread: the parent-death signal
(PR_SET_PDEATHSIG) that takes the edge down with a killed router is tied to the thread
that forks it. The edge's stdout is read by a thread of its own: its listening line
("kvserve-edge listening on HOST:PORT") resolves the start, every other line goes to
the router's log; its stderr is the router's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

from protocol.errors import KvserveError

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
"""Longest the edge may take from its start to its "listening" line."""
RESTART_FIRST_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
RESTART_STABLE_S = 60.0
"""An edge that ran this long is restarted after the first delay again."""
STOP_GRACE_S = 10.0
"""From SIGTERM to SIGKILL: the edge lets its in-flight requests finish meanwhile."""
LISTENING_PREFIX = "kvserve-edge listening on "
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


class EdgeError(KvserveError):
    """The native data plane cannot run: what is missing and what to do."""


def _set_parent_death_signal(prctl: Callable[..., int]) -> Callable[[], None]:
    """The edge's pre-exec step: SIGTERM it when the router's main thread (which starts
    every edge) ends, even by SIGKILL. `prctl` is looked up before the fork."""

    def before_exec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return before_exec


class EdgeProcess:
    """One kvserve-edge at a time: started, waited for, restarted when it exits, stopped.
    Lives on the router's event loop (the main thread: the parent-death signal is tied
    to the thread that forks)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        stopping: Callable[[], bool] = lambda: False,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self._argv = argv
        self._env = env
        self._stopping = stopping
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_s = 0.0
        self._delay_s = RESTART_FIRST_DELAY_S
        self._watch_task: asyncio.Task[None] | None = None
        self._stopped = False
        self.address: str | None = None
        """HOST:PORT of the running edge's listener (None while there is none)."""
        try:
            self._prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            self._prctl = None

    @property
    def pid(self) -> int | None:
        """The running edge's pid (None while there is none)."""
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    async def start(self) -> str:
        """Start the edge and wait for its listening line: its HOST:PORT. EdgeError when it
        exits first or takes longer than the ready timeout. Then it is watched."""
        address = await self._spawn()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        return address

    async def stop(self) -> None:
        """SIGTERM the edge, SIGKILL it after STOP_GRACE_S; no restart after this."""
        self._stopped = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            log.warning(
                "kvserve-edge (pid %d) did not stop in %g s: killing it", proc.pid, STOP_GRACE_S
            )
            proc.kill()
            proc.wait()

    async def _spawn(self) -> str:
        self.address = None
        preexec = None if self._prctl is None else _set_parent_death_signal(self._prctl)
        proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=self._env,
            close_fds=True,
            preexec_fn=preexec,
        )
        self._proc = proc
        self._started_s = time.monotonic()
        listening: concurrent.futures.Future[str] = concurrent.futures.Future()
        assert proc.stdout is not None
        threading.Thread(
            target=_read_stdout,
            args=(proc.stdout, listening),
            name="kvserve-edge-stdout",
            daemon=True,
        ).start()
        try:
            address = await asyncio.wait_for(asyncio.wrap_future(listening), self._ready_timeout_s)
        except (TimeoutError, EOFError) as e:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if isinstance(e, TimeoutError):
                what = f"did not say it listens within {self._ready_timeout_s:g} s"
            else:
                what = f"exited with {_how(proc.returncode)} before it listened"
            raise EdgeError(
                f"kvserve-edge ({' '.join(self._argv)}) {what}; its own messages are in "
                "this log above"
            ) from None
        self.address = address
        log.info("kvserve-edge (pid %d) listening on %s", proc.pid, address)
        return address

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_POLL_S)
            proc = self._proc
            if proc is None or self._stopped or self._stopping():
                continue
            code = proc.poll()
            if code is None:
                continue
            self.address = None
            if time.monotonic() - self._started_s >= RESTART_STABLE_S:
                self._delay_s = RESTART_FIRST_DELAY_S
            log.warning(
                "kvserve-edge (pid %d) exited with %s; starting it again in %g s",
                proc.pid,
                _how(code),
                self._delay_s,
            )
            await asyncio.sleep(self._delay_s)
            self._delay_s = min(RESTART_MAX_DELAY_S, self._delay_s * 2)
            if self._stopped or self._stopping():
                continue
            try:
                await self._spawn()
            except EdgeError as e:
                log.error("%s", e)  # the next turn sees it gone and tries again


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def _read_stdout(stdout: IO[bytes], listening: concurrent.futures.Future[str]) -> None:
    """The edge's stdout: its listening line resolves `listening`; every other line goes
    to the router's log. EOF before the line: EOFError."""
    for raw in stdout:
        line = raw.decode("utf-8", "replace").rstrip()
        if not listening.done() and line.startswith(LISTENING_PREFIX):
            listening.set_result(line[len(LISTENING_PREFIX) :].strip())
        elif line:
            log.info("kvserve-edge: %s", line)
    if not listening.done():
        listening.set_exception(EOFError())

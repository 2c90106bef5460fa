"""A landing peer in its own process, driven by JSON lines over stdin/stdout.

The transport conformance suite and the handoff benchmark use it as "the other process";
it is also a manual check that a transport works between two processes:

    python -m transfer.probe --transport mooncake --host 127.0.0.1 --nbytes 1048576
    python -m transfer.probe --transport cuda_ipc --device cuda:0 --nbytes 1048576

    child -> {"probe": "ready", "peer", "buffer_addr", "nbytes", "bind_address"}
    parent -> {"op": "fill", "value": 171}                      child -> {"probe": "ok"}
    parent -> {"op": "sha256", "offset": 0, "nbytes": 4096}     child -> {"probe": "ok", "sha256"}
    parent -> {"op": "close"}                                   child exits

Lines that are not probe JSON (a library printing to stdout) are skipped by the parent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from transfer.errors import TransferError
from transfer.transport import TransportConfig, create_transport

REPO_ROOT = Path(__file__).resolve().parent.parent


class ProbeProcess:
    """Parent side: owns the child process, its registered buffer's coordinates and its
    log file. Every request is bounded by timeout_s; a dead or silent child raises
    TransferError with the tail of its log."""

    def __init__(
        self,
        config: TransportConfig,
        nbytes: int,
        timeout_s: float = 60.0,
        device: str = "cpu",
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: extra environment of the child (Mooncake's MC_* knobs)."""
        self.timeout_s = timeout_s
        # Closed in close(): the log outlives this call, it is read when the child fails.
        self._log = tempfile.NamedTemporaryFile(prefix="kvserve-probe-", suffix=".log")  # noqa: SIM115
        env = dict(os.environ, **(env or {}), MC_TCP_BIND_ADDRESS=config.host)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "transfer.probe", "--transport", config.name]
        cmd += ["--host", config.host, "--protocol", config.protocol, "--nbytes", str(nbytes)]
        cmd += ["--device", device]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env
        )
        self._pending = b""
        hello = self._read()
        self.peer: str = hello["peer"]
        self.incarnation: str = hello["incarnation"]
        self.buffer_addr: int = hello["buffer_addr"]
        self.nbytes: int = hello["nbytes"]
        self.bind_address: str | None = hello["bind_address"]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL the child (a crashed peer), reaping it."""
        self._proc.kill()
        self._proc.wait()

    def fill(self, value: int) -> None:
        self._request({"op": "fill", "value": value})

    def sha256(self, offset: int, nbytes: int) -> str:
        reply = self._request({"op": "sha256", "offset": offset, "nbytes": nbytes})
        digest: str = reply["sha256"]
        return digest

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(b'{"op": "close"}\n')
                self._proc.stdin.flush()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> ProbeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self._proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                if isinstance(reply, dict) and "probe" in reply:
                    if reply["probe"] == "error":
                        raise TransferError(f"probe: {reply['message']}")
                    return reply
            remaining = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, remaining))[0] if remaining > 0 else []
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                self._log.flush()
                tail = Path(self._log.name).read_text(errors="replace")[-2000:]
                why = "exited" if ready else f"did not answer within {self.timeout_s} s"
                raise TransferError(f"probe process {why}; its log ends:\n{tail}")
            self._pending += chunk


def _serve(args: argparse.Namespace) -> None:
    config = TransportConfig(name=args.transport, host=args.host, protocol=args.protocol)
    transport = create_transport(config)
    buffer = torch.zeros(args.nbytes, dtype=torch.uint8, device=args.device)
    transport.register_tensor(buffer)  # a GPU buffer is exported (cuda_ipc)

    def reply(**fields: Any) -> None:
        sys.stdout.write(json.dumps({"probe": "ok", **fields}) + "\n")
        sys.stdout.flush()

    reply(
        probe="ready",
        peer=transport.peer_address,
        incarnation=transport.incarnation,
        buffer_addr=buffer.data_ptr(),
        nbytes=args.nbytes,
        bind_address=os.environ.get("MC_TCP_BIND_ADDRESS"),
    )
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "fill":
            buffer.fill_(msg["value"])
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
            reply()
        elif msg["op"] == "sha256":
            view = buffer[msg["offset"] : msg["offset"] + msg["nbytes"]].cpu().numpy()
            reply(sha256=hashlib.sha256(view.data).hexdigest())
        elif msg["op"] == "close":
            break
        else:
            sys.stdout.write(json.dumps({"probe": "error", "message": f"bad op {msg}"}) + "\n")
            sys.stdout.flush()
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="mooncake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--device", default="cpu", help="where the landing buffer lives")
    _serve(parser.parse_args())


if __name__ == "__main__":
    main()

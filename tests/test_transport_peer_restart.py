"""A decode rank that restarts under the name of the one that died (real Mooncake).

Mooncake names a P2P peer "host:rpc_port" with the port drawn from MC_MIN/MAX_RPC_PORT,
so a restarted peer may get its predecessor's name; the writer's Transfer Engine then
still holds the dead process's segment (its TCP data port). Here the peer first runs
with a four-port range, and its restarts draw from two ports, one of them its old one
(the other is the restart's TCP data port), so a restart gets the name half the time.

The dead peer's RPC port stays in TIME_WAIT for a minute (the peer closed the writer's
handshake connection first), and Mooncake binds without SO_REUSEADDR, so no restart
could take the name within that minute. Both peers here run with a small LD_PRELOAD
library that sets SO_REUSEADDR before each bind (a port whose TIME_WAIT connections came
from such a socket can be bound again at once); it is built with the C compiler, as
kvserve/bind_narrowing.py's library is. Without a compiler the test waits the minute out.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from transfer import TransferError, TransportConfig, create_transport
from transfer.probe import ProbeProcess

NBYTES = 1 << 20

REUSEADDR_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    int one = 1;
    if (addr != NULL && (addr->sa_family == AF_INET || addr->sa_family == AF_INET6))
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    return real_bind(fd, addr, len);
}
"""


def reuseaddr_env(tmp_path: Path) -> dict[str, str]:
    """LD_PRELOAD of a library that binds every socket with SO_REUSEADDR ({} without a
    C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return {}
    src, lib = tmp_path / "reuseaddr.c", tmp_path / "reuseaddr.so"
    src.write_text(REUSEADDR_SOURCE)
    cmd = [compiler, "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"]
    subprocess.run(cmd, check=True, capture_output=True)
    return {"LD_PRELOAD": str(lib)}


def free_port_range(n: int) -> int:
    """First of n consecutive ports that are free on 127.0.0.1 now."""
    for base in range(21000, 29000, 7):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def test_a_peer_restarted_under_its_old_name_is_written_after_note_peer(tmp_path: Path) -> None:
    config = TransportConfig(name="mooncake", host="127.0.0.1", write_timeout_s=5)
    base = free_port_range(4)
    reuse = reuseaddr_env(tmp_path)
    env = {"MC_MIN_RPC_PORT": str(base), "MC_MAX_RPC_PORT": str(base + 3), **reuse}
    sender = create_transport(config)
    source = torch.arange(NBYTES, dtype=torch.int64).to(torch.uint8)
    sender.register_buffer(source.data_ptr(), NBYTES)
    want = hashlib.sha256(source.numpy().data).hexdigest()
    first = ProbeProcess(config, NBYTES, env=env)
    second = None
    try:
        sender.note_peer(first.peer, first.incarnation)
        sender.write(first.peer, source.data_ptr(), first.buffer_addr, NBYTES)
        assert first.sha256(0, NBYTES) == want
        first.kill()
        # The restart draws from two ports of the range, one of them the dead process's,
        # so it gets the name within a few tries (Mooncake refuses a one-port range).
        port = int(first.peer.rsplit(":", 1)[1])
        low = port - 1 if port > base else port
        same = {"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(low + 1), **reuse}
        deadline = time.monotonic() + 90
        while second is None and time.monotonic() < deadline:
            try:
                second = ProbeProcess(config, NBYTES, env=same)
            except TransferError:  # both ports taken right now: draw again
                time.sleep(1)
                continue
            if second.peer != first.peer:
                second.close()
                second = None
        assert second is not None, f"no restart got the name {first.peer} in 90 s"
        assert second.incarnation != first.incarnation
        # What the soak saw: the engine writes to the dead process's data port.
        with pytest.raises(TransferError):
            sender.write(second.peer, source.data_ptr(), second.buffer_addr, NBYTES)
        address = sender.peer_address
        sender.note_peer(second.peer, second.incarnation)
        assert sender.peer_address != address  # a new engine
        second.fill(0)
        sender.write(second.peer, source.data_ptr(), second.buffer_addr, NBYTES)
        assert second.sha256(0, NBYTES) == want
        # The same incarnation again keeps the engine.
        sender.note_peer(second.peer, second.incarnation)
        assert sender.peer_address != address
        rebuilt = sender.peer_address
        sender.note_peer(second.peer, second.incarnation)
        assert sender.peer_address == rebuilt
        sender.write(second.peer, source.data_ptr(), second.buffer_addr, 4096)
    finally:
        first.close()
        if second is not None:
            second.close()
        sender.close()

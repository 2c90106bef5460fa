"""Keep listeners that kvserve cannot configure on the node's address.

Mooncake's Transfer Engine and store clients open their RPC and TCP-transport listeners
on 0.0.0.0 / [::] whatever MC_TCP_BIND_ADDRESS says (only the address they advertise
follows it), and torch's TCPStore binds the wildcard too. No option
of theirs narrows them, so the launcher narrows the `bind` call itself: a small
LD_PRELOAD library rewrites a bind to the wildcard address into a bind to
KVSERVE_BIND_ADDRESS (the node's host), and leaves every other bind alone.

    bind(0.0.0.0:p)   -> bind(host:p)                     host an IPv4 address
    bind([::]:p)      -> bind([::ffff:host]:p)            (a dual-stack socket then takes
                                                           IPv4 connections to host only)
                      -> bind([host]:p)                   host an IPv6 address
    anything else     -> unchanged

The library is compiled once per source version with the system C compiler into the
user's cache (~/.cache/kvserve, or $XDG_CACHE_HOME/kvserve). Without a compiler the
launcher says so once and the listeners stay as their libraries open them. A cluster
that wants a component's wildcard binds back sets `LD_PRELOAD: ""` in that section's
`env` (section env entries win).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

ADDRESS_VAR = "KVSERVE_BIND_ADDRESS"

SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("KVSERVE_BIND_ADDRESS");
    if (host == NULL || *host == '\0' || addr == NULL) return real_bind(fd, addr, len);
    struct in_addr v4;
    int host_is_v4 = inet_pton(AF_INET, host, &v4) == 1;
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        if (in->sin_addr.s_addr == htonl(INADDR_ANY) && host_is_v4) {
            struct sockaddr_in narrowed = *in;
            narrowed.sin_addr = v4;
            return real_bind(fd, (const struct sockaddr *)&narrowed, sizeof narrowed);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
        if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) {
            struct sockaddr_in6 narrowed = *in6;
            if (host_is_v4) {
                memset(&narrowed.sin6_addr, 0, sizeof narrowed.sin6_addr);
                narrowed.sin6_addr.s6_addr[10] = 0xff;
                narrowed.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&narrowed.sin6_addr.s6_addr[12], &v4, 4);
            } else if (inet_pton(AF_INET6, host, &narrowed.sin6_addr) != 1) {
                return real_bind(fd, addr, len);
            }
            int rc = real_bind(fd, (const struct sockaddr *)&narrowed, sizeof narrowed);
            /* An IPv6-only socket cannot take a v4-mapped address: it keeps its own bind. */
            if (rc == 0 || !host_is_v4) return rc;
        }
    }
    return real_bind(fd, addr, len);
}
"""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve"


@cache
def shim_library() -> Path | None:
    """The compiled library (built on first use), or None where it cannot be built."""
    if not sys.platform.startswith("linux"):
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    lib = cache_dir() / f"bind-narrowing-{digest}.so"
    if lib.exists():
        return lib
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning(
            "no C compiler: Mooncake and torch.distributed listeners stay on 0.0.0.0 "
            "(install gcc, or firewall their ports)"
        )
        return None
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "shim.c", Path(tmp) / lib.name
        src.write_text(SOURCE)
        cmd = [compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            log.warning(
                "building the bind-narrowing library failed (listeners stay on 0.0.0.0): %s",
                res.stderr.strip()[-500:],
            )
            return None
        os.replace(out, lib)  # atomic: concurrent launchers never load a partial file
    return lib


def narrowing_env(host: str) -> dict[str, str]:
    """Environment that keeps a component's wildcard listeners on `host` ({} when the
    library cannot be built). Appends to an LD_PRELOAD the launcher itself has."""
    lib = shim_library()
    if lib is None:
        return {}
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(lib)) if p)
    return {"LD_PRELOAD": preload, ADDRESS_VAR: host}

"""Incarnations: which run of a worker process, or of a decode rank's transport, answered.

The launcher's supervisor restarts a dead worker on the same URL, and Mooncake may give a
restarted decode rank's Transfer Engine the same "host:port" name as the dead one (it
picks the port at random from a range). Whatever a peer remembers about "the process at
this address" must therefore be tied to one incarnation, else the new process pays for
the old one's failures:

- the router tells a stream of the previous incarnation of a decode instance breaking
  (a request whose decode died while prefill still worked on it) from the current
  incarnation failing, and marks the instance unhealthy only for the latter
  (router/instances.py);
- prefill's Mooncake transport rebuilds its Transfer Engine when a landing names a peer
  it has written to under another incarnation: the engine caches a peer's segment (its
  data port) by name and never refreshes it (transfer/mooncake_te.py).

An incarnation is 16 random hex digits, minted once per process (a worker) or per
transport (a decode rank's landing arena); "" means unknown (an older peer).
"""

from __future__ import annotations

import secrets

HEADER = "kvserve-incarnation"
"""Response header of a worker's GET /health: the incarnation of the process answering."""


def new_incarnation() -> str:
    return secrets.token_hex(8)

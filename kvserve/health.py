"""Probing components over HTTP: GET /health (200 = up) and GET /status (InstanceStatus).

Uses http.client directly: no proxy environment variables apply, and a probe never waits
longer than its timeout.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from protocol.messages import InstanceStatus


@dataclass(frozen=True)
class Probe:
    """Result of one GET: `status` is the HTTP code, 0 when no answer came."""

    status: int
    body: bytes
    error: str

    @property
    def ok(self) -> bool:
        return self.status == 200


def http_get(url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> Probe:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/", headers=headers or {})
        resp = conn.getresponse()
        return Probe(resp.status, resp.read(), "" if resp.status == 200 else resp.reason)
    except ConnectionRefusedError:
        return Probe(0, b"", "connection refused")
    except TimeoutError:
        return Probe(0, b"", f"no answer in {timeout_s:g}s")
    except (OSError, http.client.HTTPException) as e:
        return Probe(0, b"", str(e) or type(e).__name__)
    finally:
        conn.close()


def fetch_status(
    url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None
) -> InstanceStatus | str:
    """A worker's InstanceStatus, or a one-line reason why it could not be read.
    `headers`: the cluster secret's (GET /status is internal)."""
    probe = http_get(url, timeout_s, headers)
    if not probe.ok:
        return f"/status: {probe.status or ''} {probe.error}".strip()
    try:
        return msgspec.json.decode(probe.body, type=InstanceStatus)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"/status is not an InstanceStatus: {e}"


@dataclass(frozen=True)
class ComponentHealth:
    """One row of `kvserve status`."""

    name: str
    kind: str
    node: str
    address: str
    pid: int | None
    health: Probe
    status: InstanceStatus | str | None
    """None for components without /status (the router)."""

    @property
    def up(self) -> bool:
        if not self.health.ok:
            return False
        if isinstance(self.status, str):
            return False
        return self.status is None or self.status.healthy


def _state_word(row: ComponentHealth) -> str:
    if row.up:
        return "up"
    if not row.health.ok:
        code = f"{row.health.status} " if row.health.status else ""
        return f"down ({code}{row.health.error})"
    if isinstance(row.status, InstanceStatus):
        return "unhealthy (/status healthy=false)"
    return f"degraded ({row.status})"


def format_table(rows: list[ComponentHealth]) -> str:
    """Fixed-width table, one line per component."""
    header = (
        "COMPONENT",
        "KIND",
        "NODE",
        "ADDRESS",
        "PID",
        "RUN",
        "WAIT",
        "KV FREE/TOTAL",
        "STATE",
    )
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        st = r.status if isinstance(r.status, InstanceStatus) else None
        lines.append(
            (
                r.name,
                r.kind,
                r.node,
                r.address,
                str(r.pid) if r.pid else "-",
                str(st.num_running) if st else "-",
                str(st.num_waiting) if st else "-",
                f"{st.kv_blocks_free}/{st.kv_blocks_total}" if st else "-",
                _state_word(r),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for line in lines:
        cells = [cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True)]
        out.append("  ".join([*cells, line[-1]]))
    return "\n".join(out)


def unseen_by_router(body: bytes, names: tuple[str, ...]) -> list[str]:
    """Of the instances `names`, those the router's GET /health `body` does not show
    healthy (all of them when the body is not the router's)."""
    try:
        health = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return list(names)
    healthy: set[str] = set()
    if isinstance(health, dict):
        for role in ("prefill", "decode", "unified"):
            section = health.get(role)
            if isinstance(section, dict):
                for inst in section.get("instances") or ():
                    if isinstance(inst, dict) and inst.get("healthy") is True:
                        healthy.add(str(inst.get("name")))
    return [n for n in names if n not in healthy]

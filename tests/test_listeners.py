"""What a live cluster listens on: every socket of every component process (Mooncake's
Transfer Engine and store clients, torch.distributed's store, uvicorn, metrics) is bound
to the node's address, never the wildcard; and the bind-narrowing library alone."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
from cluster_harness import (
    LOWEST_TEST_PORT,
    MOONCAKE_RPC_PORTS,
    _ephemeral_range,
    free_ports,
    start_cluster,
)

from kvserve.bind_narrowing import ADDRESS_VAR, narrowing_env, shim_library

NODE_ADDRESSES = {"127.0.0.1", "::ffff:127.0.0.1"}

_PROBE = """
import json, socket
out = {}
for name, family, addr in (
    ("v4_any", socket.AF_INET, ("0.0.0.0", 0)),
    ("v6_any", socket.AF_INET6, ("::", 0)),
    ("v4_loop", socket.AF_INET, ("127.0.0.1", 0)),
):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind(addr)
    s.listen()
    out[name] = s.getsockname()[0]
print(json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict[str, str]:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_the_library_narrows_wildcard_binds_only() -> None:
    assert shim_library() is not None  # CI machines have a C compiler
    base = {"PATH": "/usr/bin:/bin"}
    narrowed = _probe({**base, **narrowing_env("127.0.0.1")})
    assert narrowed == {"v4_any": "127.0.0.1", "v6_any": "::ffff:127.0.0.1", "v4_loop": "127.0.0.1"}
    other = _probe({**base, **narrowing_env("127.0.0.2")})
    assert other["v4_any"] == "127.0.0.2" and other["v4_loop"] == "127.0.0.1"
    # Loaded but without an address, it changes nothing.
    env = {**base, **narrowing_env("127.0.0.1")}
    del env[ADDRESS_VAR]
    assert _probe(env) == {"v4_any": "0.0.0.0", "v6_any": "::", "v4_loop": "127.0.0.1"}


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    """The ports a test reserves for its cluster cannot be taken meanwhile as the local
    port of an outgoing connection (a metrics port once was, before its worker bound it)."""
    first_ephemeral, _ = _ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(LOWEST_TEST_PORT <= p < first_ephemeral for p in ports), ports
    # None where Mooncake's engines pick their RPC ports (over enough picks that ~9% of
    # the range falling there would show).
    low, high = MOONCAKE_RPC_PORTS
    assert not [p for p in free_ports(300) if low <= p <= high]
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with socket.socket() as client, socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        assert client.getsockname()[1] >= first_ephemeral  # where outgoing ports come from


def _listeners(pid: int) -> list[str]:
    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        out += [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_every_listener_of_a_live_cluster_is_on_the_node_address(
    tmp_path: Path, tiny_parallel_dir: Path, weights_cache_dir: str
) -> None:
    """Pool (master + store), a PP2 prefill and a TP2 decode (torch.distributed TCP stores
    on their dist_ports, Mooncake clients of pool and handoff), the router; metrics ports
    of the workers and the router; one request through all of it."""
    dist_p, dist_d, metrics_p, metrics_d, metrics_r = free_ports(5)
    cluster = start_cluster(
        tmp_path,
        str(tiny_parallel_dir),
        cache_dir=weights_cache_dir,
        pool=True,
        prefill={
            "pipeline_parallel": 2,
            "devices": ["cpu", "cpu"],
            "dist_port": dist_p,
            "metrics_port": metrics_p,
        },
        decode={
            "tensor_parallel": 2,
            "devices": ["cpu", "cpu"],
            "dist_port": dist_d,
            "metrics_port": metrics_d,
        },
        router={"metrics_port": metrics_r},
        name="listeners",
    )
    try:
        r = httpx.post(
            cluster.router_url + "/v1/completions",
            json={"model": cluster.served_name, "prompt": [5, 6, 7, 8], "max_tokens": 4},
            trust_env=False,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        state = json.loads((tmp_path / "state" / "listeners" / "state.json").read_text())
        seen = {}
        for comp in state["components"]:
            socks = _listeners(comp["pid"])
            assert socks, comp["name"]  # each component listens somewhere
            seen[comp["name"]] = socks
        wide = {
            name: [s for s in socks if s.rsplit(":", 1)[0] not in NODE_ADDRESSES]
            for name, socks in seen.items()
        }
        assert all(not w for w in wide.values()), wide
        ports = {int(x.rsplit(":", 1)[1]) for socks in seen.values() for x in socks}
        assert {dist_p, dist_d, metrics_p, metrics_d, metrics_r} <= ports, (ports, seen)
        kinds = {c["kind"] for c in state["components"]}
        assert {"pool_master", "pool_store", "prefill", "decode", "router"} <= kinds
    finally:
        down = cluster.down()
        assert down.returncode == 0, down.stderr

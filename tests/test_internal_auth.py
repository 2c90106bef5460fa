"""Internal authentication and landing capabilities, unit level: the capability's MAC
and expiry, the workers' 401 middleware, cluster.yaml's auth section and where the
launcher finds the secret, decode's check of landed segments, and a prefill stage's
handoff worker refusing a forged landing before any byte reaches decode's buffer.
(End to end with real workers: tests/test_e2e_auth.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest
import torch
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.testclient import TestClient

from decode_worker.landing_check import segment_problem
from engine.kv_connector import WorkerPlace
from enginehost.auth import InternalAuth
from kvserve.cluster_secret import (
    configured_secret,
    describe_secret_source,
    secret_for_client,
    secret_for_launch,
)
from kvserve.run_state import RunDir
from prefill_worker.handoff import HandoffWorker
from protocol.cluster import load_cluster
from protocol.config_errors import ConfigError
from protocol.handoff_messages import FlowOpen, FlowReport, FlowSend, HandoffMeta
from protocol.internal_auth import auth_headers, new_secret
from protocol.kv_layout import KVLayout
from protocol.landing_capability import LandingCapabilityError, capability_key, mint, verify
from protocol.messages import KVSegment, LandingInfo
from transfer import LandingArena, LocalFabric, LocalTransport

L, H, D, BS = 2, 2, 8, 16
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype="float32")
SECRET = new_secret()
KEY = capability_key(SECRET)


def _info(**kw: object) -> LandingInfo:
    base: dict[str, object] = dict(
        rank=0,
        transport="mooncake",
        peer="127.0.0.1:15001",
        buffer_addr=1 << 32,
        capacity_bytes=1 << 20,
        layout=LAYOUT,
    )
    base.update(kw)
    return LandingInfo(**base)  # type: ignore[arg-type]


# -- capabilities ------------------------------------------------------------------------


def test_a_minted_landing_verifies_for_its_request_only():
    now = time.time()
    info = mint(KEY, "req-1", _info(), now + 60)
    verify(KEY, "req-1", info, now)
    # survives the wire: decode -> router -> prefill is JSON
    verify(KEY, "req-1", msgspec.json.decode(msgspec.json.encode(info), type=LandingInfo), now)
    with pytest.raises(LandingCapabilityError, match="forged or altered"):
        verify(KEY, "req-2", info, now)  # another request's landing
    with pytest.raises(LandingCapabilityError, match="forged or altered"):
        verify(capability_key(new_secret()), "req-1", info, now)  # another cluster


@pytest.mark.parametrize(
    "change",
    [
        {"buffer_addr": (1 << 32) + 4096},
        {"capacity_bytes": 1 << 30},
        {"peer": "127.0.0.1:15002"},
        {"rank": 1},
        {"transport": "cuda_ipc"},
        {"kv_head_start": 1},
        {"expires_at_s": 4e9},
        {
            "layout": KVLayout(
                num_layers=L, num_kv_heads=H, head_dim=2 * D, block_size=BS, dtype="float32"
            )
        },
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_altered_field_is_refused(change):
    now = time.time()
    info = mint(KEY, "req-1", _info(), now + 60)
    with pytest.raises(LandingCapabilityError, match="forged or altered"):
        verify(KEY, "req-1", msgspec.structs.replace(info, **change), now)


def test_expired_and_missing_capabilities_are_refused():
    now = time.time()
    with pytest.raises(LandingCapabilityError, match="expired"):
        verify(KEY, "r", mint(KEY, "r", _info(), now - 1), now)
    with pytest.raises(LandingCapabilityError, match="carries no capability"):
        verify(KEY, "r", _info(), now)


# -- the workers' middleware ------------------------------------------------------------


def _app() -> TestClient:
    app = FastAPI()
    for path in ("/health", "/metrics", "/status"):
        app.get(path)(lambda: Response(b"ok"))
    app.post("/prefill")(lambda: Response(b"ok"))
    app.add_middleware(InternalAuth, secret=SECRET)
    return TestClient(app)


def test_internal_routes_need_the_secret_health_and_metrics_do_not(caplog):
    client = _app()
    for method, path in (("GET", "/status"), ("POST", "/prefill"), ("GET", "/nowhere")):
        r = client.request(method, path)
        assert r.status_code == 401, path
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and "cluster secret" in err["message"]
        bad = {"authorization": f"Bearer {SECRET[:-1]}x"}
        assert client.request(method, path, headers=bad).status_code == 401
        assert client.request(method, path, headers={"authorization": SECRET}).status_code == 401
    assert client.post("/prefill", headers=auth_headers(SECRET)).status_code == 200
    assert client.get("/status", headers=auth_headers(SECRET)).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    # refusals are logged, but not one line each (a scan must not flood the log)
    refused = [r for r in caplog.records if "without the cluster secret" in r.getMessage()]
    assert len(refused) == 1 and "GET /status" in refused[0].getMessage()


def test_worker_bodies_are_capped_before_they_are_read_whole(monkeypatch):
    """A worker answers 413 to a body over MAX_MESSAGE_BYTES, declared or streamed."""
    import msgspec

    from enginehost import app as worker_app

    class Ping(msgspec.Struct):
        text: str

    async def ping(request: Request) -> Response:
        msg = await worker_app.read_message(request, Ping)
        if isinstance(msg, Response):
            return msg
        assert isinstance(msg, Ping)
        return Response(str(len(msg.text)).encode())

    monkeypatch.setattr(worker_app, "MAX_MESSAGE_BYTES", 1024)
    app = FastAPI()
    app.post("/ping")(ping)
    client = TestClient(app)
    assert client.post("/ping", json={"text": "x" * 500}).text == "500"
    big = msgspec.json.encode({"text": "x" * 2000})
    r = client.post("/ping", content=big)
    assert r.status_code == 413 and "exceeds 1024 bytes" in r.json()["message"]
    r = client.post("/ping", content=iter([big[:800], big[800:]]))  # chunked: no length
    assert r.status_code == 413


# -- cluster.yaml and the launcher ----------------------------------------------------------


def _cluster_yaml(tmp: Path, hosts: list[str], auth: dict | None) -> Path:
    nodes = [{"name": f"n{i}", "host": h} for i, h in enumerate(hosts)]
    cfg: dict[str, object] = {
        "name": "authtest",
        "model": "builtin:smollm2-135m-instruct",
        "nodes": nodes,
        "prefill": [{"name": "p", "node": "n0", "port": 18001, "devices": ["cpu"]}],
        "decode": [{"name": "d", "node": nodes[-1]["name"], "port": 18002, "devices": ["cpu"]}],
    }
    if auth is not None:
        cfg["auth"] = auth
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_multi_host_clusters_must_name_a_shared_secret(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"spans 2 hosts.*auth.secret_file or auth.secret_env"):
        load_cluster(_cluster_yaml(tmp_path, ["10.0.0.1", "10.0.0.2"], None))
    with pytest.raises(ConfigError, match="not both"):
        load_cluster(
            _cluster_yaml(tmp_path, ["10.0.0.1"], {"secret_file": "/x", "secret_env": "S"})
        )
    # loopback addresses are one machine: a generated secret serves
    c = load_cluster(_cluster_yaml(tmp_path, ["127.0.0.1", "127.0.0.2"], None))
    assert configured_secret(c) is None

    c = load_cluster(_cluster_yaml(tmp_path, ["10.0.0.1", "10.0.0.2"], {"secret_env": "KVS_T"}))
    monkeypatch.delenv("KVS_T", raising=False)
    with pytest.raises(ConfigError, match=r"auth.secret_env.*unset or empty"):
        describe_secret_source(c)
    monkeypatch.setenv("KVS_T", "short")
    with pytest.raises(ConfigError, match="at least 32"):
        describe_secret_source(c)
    monkeypatch.setenv("KVS_T", SECRET)
    assert configured_secret(c) == SECRET


def test_secret_file_must_be_private(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    os.chmod(secret_file, 0o644)
    c = load_cluster(
        _cluster_yaml(tmp_path, ["10.0.0.1", "10.0.0.2"], {"secret_file": str(secret_file)})
    )
    with pytest.raises(ConfigError, match=r"readable by other users.*chmod 600"):
        configured_secret(c)
    os.chmod(secret_file, 0o600)
    assert configured_secret(c) == SECRET
    secret_file.unlink()
    with pytest.raises(ConfigError, match=r"auth.secret_file.*cannot read"):
        describe_secret_source(c)


def test_a_generated_secret_is_fresh_per_run_and_private(tmp_path):
    c = load_cluster(_cluster_yaml(tmp_path, ["127.0.0.1"], None))
    run = RunDir(tmp_path / "state", c.name)
    first = secret_for_launch(c, run)
    path = run.root / "cluster_secret"
    assert path.stat().st_mode & 0o777 == 0o600
    assert secret_for_client(c, run) == first
    assert secret_for_launch(c, run) != first  # a new run, a new secret


# -- decode's check of landed segments ----------------------------------------------------


def test_landed_segments_must_lie_in_the_reserved_region():
    per_token = LAYOUT.bytes_per_token
    stripes = [(1, 0)]
    ok = KVSegment(0, 16, 0, 16 * per_token)
    assert segment_problem(ok, 16 * per_token, LAYOUT, stripes) is None
    assert "outside the" in str(segment_problem(ok, 16 * per_token - 1, LAYOUT, stripes))
    past = KVSegment(0, 16, 4096, 16 * per_token)
    assert "outside the" in str(segment_problem(past, 16 * per_token, LAYOUT, stripes))
    neg = KVSegment(0, 16, -per_token, 16 * per_token)
    assert "outside the" in str(segment_problem(neg, 32 * per_token, LAYOUT, stripes))
    short = KVSegment(0, 16, 0, 15 * per_token)
    assert "carries" in str(segment_problem(short, 32 * per_token, LAYOUT, stripes))
    other_rank = KVSegment(0, 16, 0, 16 * per_token, rank=1)
    assert "names rank 1" in str(segment_problem(other_rank, 32 * per_token, LAYOUT, stripes))
    # DCP 2: rank 1 holds the odd tokens of [0, 16): 8 of them
    dcp = [(2, 0), (2, 1)]
    half = KVSegment(0, 16, 0, 8 * per_token, rank=1)
    assert segment_problem(half, 8 * per_token, LAYOUT, dcp) is None


# -- a prefill stage refuses a forged landing before writing ---------------------------------


def _worker_and_arena() -> tuple[HandoffWorker, LandingArena, list[object]]:
    fabric = LocalFabric()
    arena = LandingArena(1 << 20, LocalTransport(fabric=fabric))
    arena.buffer.zero_()
    notices: list[object] = []

    def notify(url: str, notice: object) -> bool:
        notices.append(notice)
        return True

    worker = HandoffWorker(LocalTransport(fabric=fabric), 1 << 18, notify, capability_key=KEY)
    torch.manual_seed(0)
    worker.register_kv_caches([torch.randn(2, 8, BS, H, D) for _ in range(L)], WorkerPlace(0, L))
    return worker, arena, notices


def _send(worker: HandoffWorker, rid: str, landing: list[LandingInfo], n: int) -> str | None:
    meta = HandoffMeta(
        [FlowOpen(rid, n, landing, "http://decode")], [FlowSend(rid, 0, n, [0, 1], True)]
    )
    worker.start_saves(msgspec.msgpack.encode(meta))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        payload = worker.get_finished()
        if payload:
            (res,) = msgspec.msgpack.decode(payload, type=FlowReport).closed
            return res.error
        worker.wait(0.05)
    raise AssertionError("the flow never closed")


def test_a_forged_landing_writes_nothing_a_minted_one_lands():
    worker, arena, notices = _worker_and_arena()
    try:
        n = 32
        region = arena.allocate("victim", n * LAYOUT.bytes_per_token, 1)
        assert region is not None
        genuine = arena.landing_info(region, 0, LAYOUT)
        minted = mint(KEY, "victim", genuine, time.time() + 60)
        forged = [
            genuine,  # no capability at all
            msgspec.structs.replace(minted, buffer_addr=minted.buffer_addr + 4096),
            mint(capability_key(new_secret()), "victim", genuine, time.time() + 60),
        ]
        for i, landing in enumerate(forged):
            error = _send(worker, f"attacker-{i}", [landing], n)
            assert error is not None and "landing" in error, error
        # the victim's landing replayed under another request id is refused too
        error = _send(worker, "attacker-replay", [minted], n)
        assert error is not None and "forged or altered" in error
        assert not notices  # nothing told decode anything landed
        assert not arena.buffer.any()  # and not one byte was written
        assert _send(worker, "victim", [minted], n) is None
        assert arena.buffer.any()
    finally:
        worker.close()
        arena.close()

"""Router pieces on their own: routing policies, the instance registry, the session a
request names, settings from cluster.yaml, and the `python -m router -c cluster.yaml`
entry point."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from router_standin import ServerThread, StandinWorker

from protocol.cluster import AdmissionConfig, parse_cluster_yaml
from protocol.hashing import hash_chain, namespace_seed
from router.config import settings_from_cluster
from router.instances import Instance, InstanceRegistry
from router.policies import RouteContext, make_policy, policy_names
from router.request_body import Headers
from router.serving import ServingContext

REPO = Path(__file__).resolve().parent.parent


def _instances(role: str, n: int) -> list[Instance]:
    return [Instance(f"{role[0]}{i}", role, f"http://127.0.0.1:{9000 + i}") for i in range(n)]  # type: ignore[arg-type]


def test_round_robin_cycles_per_role() -> None:
    policy = make_policy("round_robin")
    ctx = RouteContext("r", [1, 2, 3])
    prefill, decode = _instances("prefill", 3), _instances("decode", 2)
    assert [policy.choose("prefill", ctx, prefill).name for _ in range(4)] == [
        "p0",
        "p1",
        "p2",
        "p0",
    ]
    assert [policy.choose("decode", ctx, decode).name for _ in range(3)] == ["d0", "d1", "d0"]


def test_random_is_seeded_and_uses_every_candidate() -> None:
    candidates = _instances("prefill", 4)
    ctx = RouteContext("r", [1])
    picks = [
        make_policy("random", seed=7).choose("prefill", ctx, candidates).name for _ in range(3)
    ]
    assert len(set(picks)) == 1  # same seed, same first choice
    policy = make_policy("random", seed=1)
    assert {policy.choose("prefill", ctx, candidates).name for _ in range(200)} == {
        "p0",
        "p1",
        "p2",
        "p3",
    }


def test_unknown_policy_names_the_known_ones() -> None:
    assert set(policy_names()) >= {"round_robin", "random"}
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("telepathy")


def test_registry_skips_unhealthy_and_tried() -> None:
    prefill = _instances("prefill", 3)
    registry = InstanceRegistry(prefill, _instances("decode", 1))
    registry.mark_unhealthy(prefill[1], "refused")
    assert [i.name for i in registry.candidates("prefill")] == ["p0", "p2"]
    assert [i.name for i in registry.candidates("prefill", frozenset({"p0"}))] == ["p2"]
    registry.mark_healthy(prefill[1])
    assert len(registry.candidates("prefill")) == 3
    assert registry.summary()["prefill"]["healthy"] == 3


def test_a_broken_stream_of_a_restarted_instance_leaves_the_new_process_routable() -> None:
    decode = _instances("decode", 1)
    registry = InstanceRegistry(_instances("prefill", 1), decode)
    registry.mark_healthy(decode[0], "aaaa")  # /health: the first process
    assert registry.mark_unhealthy(decode[0], "stream broke", "aaaa")
    assert not decode[0].healthy
    registry.mark_healthy(decode[0], "bbbb")  # the supervisor restarted it
    assert decode[0].healthy and decode[0].incarnation == "bbbb"
    # A stream of the dead process breaks late: not the new one's fault.
    assert not registry.mark_unhealthy(decode[0], "stream broke", "aaaa")
    assert decode[0].healthy
    assert registry.summary()["decode"]["instances"][0]["incarnation"] == "bbbb"
    # The current process failing, or a failure of unknown origin, marks it.
    assert registry.mark_unhealthy(decode[0], "stream broke", "bbbb")
    registry.mark_healthy(decode[0], "bbbb")
    assert registry.mark_unhealthy(decode[0], "refused")
    assert not decode[0].healthy


def test_requests_bound_to_a_decode_process_fail_when_it_goes() -> None:
    """router/decode_bindings.py: a binding's guard passes prefill's events, and raises
    DecodeLost at once (its pending read cancelled) when the registry learns the decode
    process is gone: refused / broken (not a timed-out poll), or restarted; a binding
    released at prefill's first event is not touched."""
    import asyncio

    from router.decode_bindings import DecodeLost

    async def main() -> None:
        decode = _instances("decode", 1)
        registry = InstanceRegistry(_instances("prefill", 1), decode)
        registry.mark_healthy(decode[0], "aaaa")
        b = registry.bindings
        gate = asyncio.Event()
        unwound: list[str] = []

        async def prefill_events(n: int):  # type: ignore[no-untyped-def]
            try:
                await gate.wait()
                for i in range(n):
                    yield i
            finally:
                unwound.append("prefill read unwound")

        async def drain(binding):  # type: ignore[no-untyped-def]
            return [e async for e in binding.guard(prefill_events(2))]

        # released at the first event: a later loss does not concern it
        done = b.bind(decode[0], "aaaa", "r0")
        task = asyncio.ensure_future(drain(done))
        await asyncio.sleep(0)
        assert b.num_bound(decode[0]) == 1
        gate.set()
        assert await task == [0, 1]
        assert b.num_bound(decode[0]) == 0
        gate.clear()

        # lost while waiting: refused connection (down), restarted, but not a timeout
        for how in ("refused", "restarted", "broken stream"):
            waiting = b.bind(decode[0], decode[0].incarnation, f"r-{how}")
            task = asyncio.ensure_future(drain(waiting))
            await asyncio.sleep(0.01)
            registry.mark_unhealthy(decode[0], "ReadTimeout: slow", down=False)
            await asyncio.sleep(0.01)
            assert not task.done(), "a slow decode is not a dead one"
            unwound.clear()
            if how == "refused":
                registry.mark_unhealthy(decode[0], "ConnectError: refused")
            elif how == "restarted":
                registry.mark_healthy(decode[0], "bbbb")
            else:
                assert not registry.mark_unhealthy(decode[0], "broke", "zzzz")  # stale
                await asyncio.sleep(0.01)
                assert not task.done()
                registry.mark_unhealthy(decode[0], "broke", decode[0].incarnation)
            with pytest.raises(DecodeLost, match="decode instance d0") as e:
                await asyncio.wait_for(task, 5)
            assert e.value.status == 503 and e.value.code == "decode_instance_lost"
            assert unwound == ["prefill read unwound"]
            assert b.num_bound(decode[0]) == 0
            registry.mark_healthy(decode[0], decode[0].incarnation)
            if how == "restarted":  # bindings of the new process survive further polls
                assert decode[0].incarnation == "bbbb"

        # no task of its own: 50 waiting requests are 50 tasks (theirs), not 100
        before = len(asyncio.all_tasks())
        waiting_tasks = [
            asyncio.ensure_future(drain(b.bind(decode[0], decode[0].incarnation, f"m{i}")))
            for i in range(50)
        ]
        await asyncio.sleep(0.01)
        assert len(asyncio.all_tasks()) == before + 50
        registry.mark_unhealthy(decode[0], "ConnectError: refused")
        results = await asyncio.gather(*waiting_tasks, return_exceptions=True)
        assert all(isinstance(r, DecodeLost) for r in results), results
        registry.mark_healthy(decode[0], decode[0].incarnation)

        # the request's own cancellation (its client left) stays a cancellation, also
        # when the decode is lost in the same turn of the loop
        for also_lost in (False, True):
            task = asyncio.ensure_future(drain(b.bind(decode[0], decode[0].incarnation, "c")))
            await asyncio.sleep(0.01)
            task.cancel()
            if also_lost:
                registry.mark_unhealthy(decode[0], "ConnectError: refused")
            with pytest.raises(asyncio.CancelledError):
                await task
            assert b.num_bound(decode[0]) == 0
            registry.mark_healthy(decode[0], decode[0].incarnation)

        # lost before the guard is entered: DecodeLost at once, prefill never read
        early = b.bind(decode[0], decode[0].incarnation, "early")
        registry.mark_unhealthy(decode[0], "ConnectError: refused")
        unwound.clear()
        with pytest.raises(DecodeLost):
            await drain(early)
        assert b.num_bound(decode[0]) == 0

    asyncio.run(main())


def test_route_context_hashes_once() -> None:
    tokens = list(range(40))
    ctx = RouteContext("r", tokens)
    root = namespace_seed("ns")
    hashes = ctx.block_hashes(16, root)
    assert hashes == hash_chain(tokens, 16, root) and len(hashes) == 2
    assert ctx.block_hashes(16, root) is hashes


def _cluster_yaml(prefill_port: int, decode_port: int, router_port: int, policy: str) -> str:
    text = (REPO / "deploy/examples/local-pd.yaml").read_text()
    text = text.replace("port: 8100", f"port: {prefill_port}").replace(
        "port: 8200", f"port: {decode_port}"
    )
    text = text.replace("port: 8000", f"port: {router_port}")
    return text.replace("policy: round_robin", f"policy: {policy}")


class _Request:
    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.headers = Headers(raw)


def test_session_is_the_first_session_header_sent_non_empty() -> None:
    """Headers in the order of preference, each header's first occurrence, empty values
    skipped, names case-insensitive in the settings; else the `user` field."""
    ctx = ServingContext(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        1.0,
        None,
        session_headers=("X-Session-Id", "session_id", "conversation_id"),
    )
    raw = [(b"host", b"h"), (b"conversation_id", b"conv"), (b"session_id", b"sess")]
    assert ctx.session_of(_Request(raw), "u") == "sess"
    raw = [(b"x-session-id", b""), (b"x-session-id", b"later"), (b"conversation_id", b"c")]
    assert ctx.session_of(_Request(raw), "u") == "c"
    assert ctx.session_of(_Request([(b"x-session-id", b"\xe9t\xe9")]), None) == "\xe9t\xe9"
    assert ctx.session_of(_Request([(b"host", b"h")]), "u") == "u"
    assert ctx.session_of(_Request([]), None) is None


def test_settings_from_cluster() -> None:
    cluster = parse_cluster_yaml(_cluster_yaml(8101, 8201, 8001, "kv_aware"))
    s = settings_from_cluster(cluster)
    assert s.policy == "kv_aware"
    assert s.admission and s.admission_headroom == 0.9 and s.admission_wait_timeout_s == 30
    assert (s.admission_order, s.admission_pass_bound_s) == ("fifo", 1.0)
    admission = AdmissionConfig(order="fits_first", pass_bound_s=2.5)
    router = msgspec.structs.replace(cluster.router, admission=admission)
    s2 = settings_from_cluster(msgspec.structs.replace(cluster, router=router))
    assert (s2.admission_order, s2.admission_pass_bound_s) == ("fits_first", 2.5)
    assert s.health_timeout_s == 1.0
    router = msgspec.structs.replace(cluster.router, health_timeout_s=0.25)
    s3 = settings_from_cluster(msgspec.structs.replace(cluster, router=router))
    assert s3.health_timeout_s == 0.25
    assert s.health_interval_s == 1.0
    text = _cluster_yaml(8101, 8201, 8001, "kv_aware").replace(
        "\nrouter:\n", "\nrouter:\n  health_interval_s: 2.5\n"
    )
    assert settings_from_cluster(parse_cluster_yaml(text)).health_interval_s == 2.5
    # unset, the period follows a timeout longer than its 1 s default (a cluster.yaml that
    # set only the timeout stays valid)
    text = _cluster_yaml(8101, 8201, 8001, "kv_aware").replace(
        "\nrouter:\n", "\nrouter:\n  health_timeout_s: 3\n"
    )
    assert settings_from_cluster(parse_cluster_yaml(text)).health_interval_s == 3.0
    assert [(e.name, e.url) for e in s.prefill] == [("prefill-0", "http://127.0.0.1:8101")]
    assert [(e.name, e.url) for e in s.decode] == [("decode-0", "http://127.0.0.1:8201")]
    assert (s.host, s.port, s.request_timeout_s) == ("127.0.0.1", 8001, 300)
    assert s.served_model_name == "smollm2-135m-instruct"
    assert s.model == "builtin:smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_python_m_router_serves_a_cluster_file(tmp_path: Path) -> None:
    workers = [StandinWorker(tokens=[100, 101, 102]) for _ in range(2)]
    servers = [ServerThread(w.app()) for w in workers]
    for s in servers:
        s.start()
    router_port = _free_port()
    config = tmp_path / "cluster.yaml"
    config.write_text(_cluster_yaml(servers[0].port, servers[1].port, router_port, "random"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "-c", str(config)], env=env, cwd=tmp_path
    )
    url = f"http://127.0.0.1:{router_port}"
    try:
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, "the router exited"
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router did not come up"
            time.sleep(0.1)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 3},
            trust_env=False,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for s in servers:
            s.stop()


def test_bad_cluster_file_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("name: x\nrouter: {port: nope}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "router", "-c", str(config)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and "router:" in out.stderr and "Traceback" not in out.stderr

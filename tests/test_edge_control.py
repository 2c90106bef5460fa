"""The native data plane's control socket: the real Rust client (`kvserve-edge control`,
edge/src/control.rs) against the real EdgeControl (router/edge_control.py) over a
RelayServices of stand-in instances (no worker runs: only decisions are asked). Each
decision is compared with what the Python router's own code gives for the same state."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from protocol.hashing import namespace_seed
from protocol.kv_events import WorkerInfo
from protocol.messages import PromptUsage
from protocol.sampling import SamplingParams
from router.admission import AdmissionGate, AdmissionSettings
from router.cluster_view import ClusterView
from router.edge_control import EdgeControl
from router.errors import WorkerUnavailable
from router.instances import Instance, InstanceRegistry
from router.metrics import RequestRecord, RouterMetrics
from router.policies import RouteContext, make_policy
from router.relay import RelayServices, RequestRun
from router.worker_client import WorkerClient

pytestmark = pytest.mark.timeout(60)

NS = "edge-control-test"
BS = 16
ANSWER_S = 10.0


def _info(name: str, role: str, capacity: int = 100_000) -> WorkerInfo:
    return WorkerInfo(
        name=name,
        role=role,
        namespace_key=NS,
        block_size=BS,
        chunk_size=256,
        kv_bytes_per_token=1000,
        kv_capacity_tokens=capacity,
    )


class Cluster:
    """Stand-in instances, the router's shared services and an EdgeControl over them."""

    def __init__(
        self,
        *,
        num_prefill: int = 2,
        num_decode: int = 1,
        num_unified: int = 0,
        decode_capacity: int = 100_000,
        wait_timeout_s: float = 30.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        port = itertools.count(9100)
        self.registry = InstanceRegistry(
            [
                Instance(f"p{i}", "prefill", f"http://127.0.0.1:{next(port)}")
                for i in range(num_prefill)
            ],
            [
                Instance(f"d{i}", "decode", f"http://127.0.0.1:{next(port)}")
                for i in range(num_decode)
            ],
            [
                Instance(f"u{i}", "unified", f"http://127.0.0.1:{next(port)}")
                for i in range(num_unified)
            ],
        )
        self.metrics = RouterMetrics(policy="kv_aware")
        self.metrics.watch_instances(self.registry)
        self.view = ClusterView()
        for inst in self.registry.all():
            cap = decode_capacity if inst.role == "decode" else 100_000
            self.view.set_info(inst, _info(inst.name, inst.role, cap))
        gate = None
        if num_decode:
            settings = AdmissionSettings(wait_timeout_s=wait_timeout_s)
            gate = AdmissionGate(self.view, settings, self.metrics)
        self.services = RelayServices(
            registry=self.registry,
            policy=make_policy("kv_aware", 0, self.view),
            client=WorkerClient(),
            on_route=self.metrics.on_route,
            view=self.view,
            gate=gate,
        )
        self.control = EdgeControl(self.services, self.metrics, request_timeout_s=request_timeout_s)

    def inst(self, name: str) -> Instance:
        return next(i for i in self.registry.all() if i.name == name)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def assert_nothing_held(self) -> None:
        """No request left any state behind."""
        assert self.control.num_open() == 0
        for inst in self.registry.all():
            st = self.view.state(inst)
            assert st.reserved == {}, inst.name
            assert st.outstanding == {}, inst.name
            if inst.role == "decode":
                assert self.registry.bindings.num_bound(inst) == 0, inst.name
        assert self.sample("kvserve_router_requests_in_flight") == 0
        assert self.sample("kvserve_router_admission_waiting") == 0


class Driver:
    """The Rust client's test driver: one JSON line per call, answers by tag."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._tags = itertools.count(1)
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.lost: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            msg = json.loads(line)
            if "lost" in msg:
                self.lost.put_nowait(msg)
            elif "tag" in msg and msg["tag"] in self._answers:
                self._answers.pop(msg["tag"]).set_result(msg)
            else:
                raise AssertionError(f"unexpected driver output: {msg}")

    def send(self, call: str, **args: Any) -> asyncio.Future[dict[str, Any]]:
        """Send one call; its answer's future."""
        tag = next(self._tags)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[tag] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"call": call, "tag": tag, **args}).encode() + b"\n")
        return fut

    async def call(self, call: str, **args: Any) -> dict[str, Any]:
        return await asyncio.wait_for(self.send(call, **args), ANSWER_S)

    async def sync(self) -> None:
        """Every call sent so far has been applied by the router."""
        assert "ok" in await self.call("ping")

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), ANSWER_S)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._reader.cancel()


@asynccontextmanager
async def _connected(edge_bin: Path, cluster: Cluster) -> AsyncIterator[Driver]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "control.sock")
        await cluster.control.start(path)
        assert os.stat(path).st_mode & 0o777 == 0o600
        proc = await asyncio.create_subprocess_exec(
            str(edge_bin),
            "control",
            "--socket",
            path,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        driver = Driver(proc)
        try:
            yield driver
        finally:
            await driver.close()
            await cluster.control.stop()
            await cluster.services.client.aclose()


def _run(edge_bin: Path, cluster: Cluster, body: Callable[[Driver], Awaitable[None]]) -> None:
    async def main() -> None:
        async with _connected(edge_bin, cluster) as driver:
            await body(driver)

    asyncio.run(main())


def _usage(n: int, gpu: int = 0) -> dict[str, int]:
    return {"prompt_tokens": n, "gpu_tokens": gpu, "pool_tokens": 0, "computed_tokens": n - gpu}


def _inst(cluster: Cluster, answer: dict[str, Any]) -> Instance:
    assert "instance" in answer, answer
    inst = cluster.inst(answer["instance"]["name"])
    assert answer["instance"]["url"] == inst.url
    return inst


def _open(
    driver: Driver, rid: str, n: int = 40, max_tokens: int = 8, **kw: Any
) -> Awaitable[dict[str, Any]]:
    prompt = list(range(1, n + 1))
    return driver.call(
        "open", id=rid, prompt=prompt, max_tokens=max_tokens, endpoint="completion", **kw
    )


_REQUEST_METRICS = (
    "kvserve_router_requests",
    "kvserve_router_time_to_first_token_seconds",
    "kvserve_router_inter_token_latency_seconds",
    "kvserve_router_e2e_request_latency_seconds",
    "kvserve_router_prompt_tokens",
    "kvserve_router_generation_tokens",
    "kvserve_router_requests_in_flight",
)


def _samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in metrics.registry.collect()
        if m.name in _REQUEST_METRICS
        for s in m.samples
        if not s.name.endswith("_created")  # when the series was made, not what it counts
    }


def test_a_request_from_open_to_end(edge_bin: Path) -> None:
    """open -> admit -> pick -> bind -> prefilled -> end: each decision the router's,
    the reservation, queued work and binding held exactly while they should be, and the
    request's metrics those of the same request served by the Python router."""
    c = Cluster()

    async def body(driver: Driver) -> None:
        assert (await driver.call("topology"))["topology"] == "pd"
        assert "ok" in await _open(driver, "r1", n=40, max_tokens=8, user="u", session="s1")
        decode = _inst(c, await driver.call("admit_decode", id="r1", tried=[], deadline_s=5))
        assert c.view.state(decode).reserved == {"r1": 48}  # prompt + max_tokens
        prefill = _inst(c, await driver.call("pick", id="r1", role="prefill", tried=[]))
        assert prefill.role == "prefill"
        assert c.view.state(prefill).outstanding == {"r1": 40}
        await driver.call(
            "bind", id="r1", instance={"name": decode.name, "url": decode.url}, incarnation="i1"
        )
        await driver.sync()
        assert c.registry.bindings.num_bound(decode) == 1
        await driver.call(
            "prefilled",
            id="r1",
            instance={"name": prefill.name, "url": prefill.url},
            usage=_usage(40),
        )
        await driver.sync()
        assert c.registry.bindings.num_bound(decode) == 0
        st = c.view.state(prefill)
        assert st.outstanding == {}
        expected = RouteContext("r1", list(range(1, 41))).block_hashes(BS, namespace_seed(NS))
        assert len(expected) == 2 and set(expected) <= st.prefix.blocks  # cached there now
        assert c.view.state(decode).reserved == {"r1": 48}  # until the end
        gaps = [0.02] * 7
        await driver.call(
            "end",
            id="r1",
            status=200,
            prompt_tokens=40,
            completion_tokens=8,
            usage=_usage(40),
            first_token_s=0.05,
            last_token_s=0.19,
            token_gaps_s=gaps,
        )
        await driver.sync()
        c.assert_nothing_held()
        assert (
            c.sample(
                "kvserve_router_routed_total",
                policy="kv_aware",
                role="prefill",
                instance=prefill.name,
            )
            == 1
        )
        assert (
            c.sample(
                "kvserve_router_routed_total",
                policy="kv_aware",
                role="decode",
                instance=decode.name,
            )
            == 1
        )
        # The same request through RequestRecord, as the Python router counts it.
        python = RouterMetrics(policy="kv_aware")
        record = RequestRecord(python, "completion")
        t = record.timing
        t.arrival, t.first_token, t.last_token, t.token_gaps = 0.0, 0.05, 0.19, gaps
        record.finish(200, PromptUsage(40, 0, 0, 40), 8)
        assert _samples(c.metrics) == _samples(python)
        assert c.sample("kvserve_router_requests_total", endpoint="completion", status="200") == 1

    _run(edge_bin, c, body)


def test_admission_waits_rejects_and_times_out(edge_bin: Path) -> None:
    """A request without decode headroom waits in the gate's line and goes when KV frees;
    the gate's 429 (retry-after) when its wait runs out, the run's 504 when its deadline
    comes first, the gate's 400 for a request no budget holds."""
    c = Cluster(decode_capacity=100, wait_timeout_s=0.4, request_timeout_s=7.0)  # budget 90

    async def body(driver: Driver) -> None:
        await _open(driver, "a", n=40, max_tokens=30)
        await _open(driver, "b", n=40, max_tokens=30)
        d0 = _inst(c, await driver.call("admit_decode", id="a", tried=[], deadline_s=5))
        waiting = driver.send("admit_decode", id="b", tried=[], deadline_s=5)
        await driver.sync()
        assert not waiting.done()
        assert c.sample("kvserve_router_admission_waiting") == 1
        await driver.call("end", id="a", status=200, completion_tokens=30)
        assert _inst(c, await asyncio.wait_for(waiting, ANSWER_S)) is d0
        assert c.view.state(d0).reserved == {"b": 70}

        await _open(driver, "c", n=40, max_tokens=30)
        busy = await driver.call("admit_decode", id="c", tried=[], deadline_s=5)
        err = busy["error"]
        assert err["status"] == 429 and err["type"] == "rate_limit_error"
        assert err["code"] == "kv_capacity_exceeded" and err["headers"] == {"retry-after": "1"}
        assert "within 0.4 s (router.admission.wait_timeout_s)" in err["message"]
        assert c.sample("kvserve_router_admission_rejections_total", reason="wait_timeout") == 1

        c.services.gate.settings = AdmissionSettings(wait_timeout_s=30.0)  # type: ignore[union-attr]
        late = await driver.call("admit_decode", id="c", tried=[], deadline_s=0.2)
        err = late["error"]
        assert err["status"] == 504 and err["type"] == "timeout"
        assert err["message"] == "request c did not finish within 7 s (router.request_timeout_s)"

        await _open(driver, "big", n=40, max_tokens=60)
        never = (await driver.call("admit_decode", id="big", tried=[], deadline_s=5))["error"]
        assert never["status"] == 400 and never["code"] == "kv_budget_exceeded"

        # An admission wait that the run's end cuts short is answered (and holds nothing).
        cut = driver.send("admit_decode", id="c", tried=[], deadline_s=5)
        await driver.sync()
        assert c.sample("kvserve_router_admission_waiting") == 1
        for rid, status in (("c", 499), ("b", 200), ("big", 400)):
            await driver.call("end", id=rid, status=status)
        assert "error" in await asyncio.wait_for(cut, ANSWER_S)
        await driver.sync()
        c.assert_nothing_held()
        assert c.sample("kvserve_router_requests_total", endpoint="completion", status="499") == 1

    _run(edge_bin, c, body)


def test_no_healthy_instance_is_the_routers_503(edge_bin: Path) -> None:
    c = Cluster()

    async def body(driver: Driver) -> None:
        for p in c.registry.instances("prefill"):
            c.registry.mark_unhealthy(p, "down for the test")
        await _open(driver, "r1")
        await driver.call("admit_decode", id="r1", tried=[], deadline_s=5)
        err = (await driver.call("pick", id="r1", role="prefill", tried=["p0"]))["error"]
        run = RequestRun(c.services, RouteContext("r1", [1]), SamplingParams(), 10.0)
        with pytest.raises(WorkerUnavailable) as python:
            run._candidates("prefill", {"p0"})
        e = python.value
        assert (err["status"], err["message"], err["type"], err["code"], err["headers"]) == (
            e.status,
            e.message,
            e.type,
            e.code,
            e.headers,
        )
        assert err["status"] == 503 and err["headers"] == {"retry-after": "1"}
        await driver.call("end", id="r1", status=503)
        await driver.sync()
        c.assert_nothing_held()
        assert c.sample("kvserve_router_requests_total", endpoint="completion", status="503") == 1

    _run(edge_bin, c, body)


def test_unreachable_marks_unhealthy_and_releases(edge_bin: Path) -> None:
    c = Cluster(num_decode=2)

    async def body(driver: Driver) -> None:
        await _open(driver, "r1")
        first = _inst(c, await driver.call("admit_decode", id="r1", tried=[], deadline_s=5))
        ref = {"name": first.name, "url": first.url}
        await driver.call("unreachable", id="r1", instance=ref, message="connection refused")
        await driver.sync()
        assert not first.healthy and first.last_error == "connection refused"
        assert c.view.state(first).reserved == {}
        second = _inst(
            c, await driver.call("admit_decode", id="r1", tried=[first.name], deadline_s=5)
        )
        assert second is not first and c.view.state(second).reserved == {"r1": 48}
        p = _inst(c, await driver.call("pick", id="r1", role="prefill", tried=[]))
        assert c.view.state(p).outstanding == {"r1": 40}
        await driver.call(
            "unreachable", id="r1", instance={"name": p.name, "url": p.url}, message="refused"
        )
        q = _inst(c, await driver.call("pick", id="r1", role="prefill", tried=[p.name]))
        assert q is not p and not p.healthy
        assert c.view.state(p).outstanding == {} and c.view.state(q).outstanding == {"r1": 40}
        await driver.call("end", id="r1", status=502)
        await driver.sync()
        c.assert_nothing_held()

    _run(edge_bin, c, body)


def test_broken_stream_and_the_incarnation_rule(edge_bin: Path) -> None:
    """A stream that broke marks its instance unhealthy, unless it came from a process
    that has been replaced since (relay.py `_broken`)."""
    c = Cluster(num_prefill=0, num_decode=0, num_unified=2)

    async def body(driver: Driver) -> None:
        assert (await driver.call("topology"))["topology"] == "unified"
        await _open(driver, "r1")
        u = _inst(c, await driver.call("pick", id="r1", role="unified", tried=[]))
        ref = {"name": u.name, "url": u.url}
        await driver.call("prefilled", id="r1", instance=ref, usage=_usage(40, gpu=16))
        c.registry.mark_healthy(u, "new")
        await driver.call("broken", id="r1", instance=ref, message="reset", incarnation="old")
        await driver.sync()
        assert u.healthy  # the old process's stream: the new one stays routable
        await driver.call("broken", id="r1", instance=ref, message="reset", incarnation="new")
        await driver.sync()
        assert not u.healthy and u.last_error == "reset"
        await driver.call("end", id="r1", status=502, usage=_usage(40, gpu=16), first_token_s=0.01)
        await driver.sync()
        c.assert_nothing_held()
        assert c.sample("kvserve_router_prompt_tokens_total", source="gpu") == 16

    _run(edge_bin, c, body)


def test_lost_decode_pushes_the_routers_503(edge_bin: Path) -> None:
    """Requests bound to a decode process that goes away get `lost` with the error the
    Python router answers (decode_bindings.py DecodeLost); one already prefilled does not."""
    c = Cluster(num_decode=1)

    async def body(driver: Driver) -> None:
        d0 = c.inst("d0")
        c.registry.mark_healthy(d0, "inc-1")
        refs = {}
        for rid in ("r1", "r2", "r3"):
            await _open(driver, rid)
            await driver.call("admit_decode", id=rid, tried=[], deadline_s=5)
            p = _inst(c, await driver.call("pick", id=rid, role="prefill", tried=[]))
            refs[rid] = {"name": p.name, "url": p.url}
            await driver.call(
                "bind", id=rid, instance={"name": "d0", "url": d0.url}, incarnation="inc-1"
            )
        await driver.call("prefilled", id="r3", instance=refs["r3"], usage=_usage(40))
        await driver.sync()
        assert c.registry.bindings.num_bound(d0) == 2
        c.registry.mark_healthy(d0, "inc-2")  # the supervisor restarted it
        pushed = [await asyncio.wait_for(driver.lost.get(), ANSWER_S) for _ in range(2)]
        assert sorted(m["lost"] for m in pushed) == ["r1", "r2"]
        # What the Python router's binding answers for the same loss.
        expected = c.registry.bindings.bind(d0, "inc-1", "r1")
        expected.lose("it was restarted: a new process answers /health")
        e = expected.error()
        expected.release()
        got = next(m["error"] for m in pushed if m["lost"] == "r1")
        assert (got["status"], got["message"], got["type"], got["code"], got["headers"]) == (
            e.status,
            e.message,
            e.type,
            e.code,
            e.headers,
        )
        assert got["code"] == "decode_instance_lost" and got["headers"] == {"retry-after": "1"}
        for rid in ("r1", "r2", "r3"):
            await driver.call("end", id=rid, status=503 if rid != "r3" else 200)
        await driver.sync()
        assert driver.lost.empty()
        c.assert_nothing_held()

    _run(edge_bin, c, body)


def test_edge_exit_ends_every_request(edge_bin: Path) -> None:
    """The edge process dies mid-requests: the router ends each (reservation, waiting
    admission, queued prefill work released; counted as 500)."""
    c = Cluster(decode_capacity=100)

    async def body(driver: Driver) -> None:
        await _open(driver, "a", n=40, max_tokens=30)
        await _open(driver, "b", n=40, max_tokens=30)
        await driver.call("admit_decode", id="a", tried=[], deadline_s=5)
        await driver.call("pick", id="a", role="prefill", tried=[])
        driver.send("admit_decode", id="b", tried=[], deadline_s=5)
        await driver.sync()
        assert c.control.num_open() == 2 and c.sample("kvserve_router_admission_waiting") == 1
        driver.proc.kill()
        await driver.proc.wait()
        for _ in range(500):  # the connection's end, then the cancelled wait's unwinding
            if c.control.num_open() == 0 and c.sample("kvserve_router_admission_waiting") == 0:
                break
            await asyncio.sleep(0.01)
        c.assert_nothing_held()
        assert c.sample("kvserve_router_requests_total", endpoint="completion", status="500") == 2

    _run(edge_bin, c, body)


def test_router_gone_fails_pending_and_later_asks(edge_bin: Path) -> None:
    c = Cluster(decode_capacity=100)

    async def body(driver: Driver) -> None:
        await _open(driver, "a", n=40, max_tokens=30)
        await _open(driver, "b", n=40, max_tokens=30)
        await driver.call("admit_decode", id="a", tried=[], deadline_s=5)
        pending = driver.send("admit_decode", id="b", tried=[], deadline_s=5)
        await driver.sync()
        await c.control.stop()
        for answer in (await asyncio.wait_for(pending, ANSWER_S), await _open(driver, "c")):
            err = answer["error"]
            assert err["status"] == 503 and err["code"] == "control_plane_unavailable"
            assert err["headers"] == {"retry-after": "1"}
        assert (await driver.call("end", id="a", status=200))["ok"]  # a report: dropped
        c.assert_nothing_held()

    _run(edge_bin, c, body)


def test_malformed_frames_are_answered_not_fatal() -> None:
    """A frame the router cannot read answers its ask (if it has a seq) with a 500, and
    the connection stays up; an unknown request's report is ignored."""
    c = Cluster()

    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "control.sock")
            await c.control.start(path)
            reader, writer = await asyncio.open_unix_connection(path)

            async def frame() -> dict[str, Any]:
                (n,) = struct.unpack("<I", await reader.readexactly(4))
                return json.loads(await reader.readexactly(n))

            def send(obj: object) -> None:
                body = json.dumps(obj).encode()
                writer.write(struct.pack("<I", len(body)) + body)

            assert await frame() == {"hello": {"version": 1, "topology": "pd"}}
            send({"op": "open", "seq": 5})
            answer = await frame()
            assert answer["seq"] == 5 and answer["error"]["status"] == 500
            send({"op": "end", "id": "never-opened", "status": 200})
            send({"op": "pick", "seq": 6, "id": "never-opened", "role": "prefill"})
            answer = await frame()
            assert answer["seq"] == 6 and "is not open" in answer["error"]["message"]
            ping = json.dumps({"op": "ping", "seq": 7}).encode()
            whole = struct.pack("<I", len(ping)) + ping
            for i in range(len(whole)):  # a frame that comes in pieces
                writer.write(whole[i : i + 1])
                await writer.drain()
            assert await frame() == {"seq": 7}

            # An admission wait cut short before its task ran: still answered.
            c.view.set_info(c.inst("d0"), _info("d0", "decode", capacity=100))
            for rid in ("a", "b"):
                prompt = list(range(40))
                send(
                    {
                        "op": "open",
                        "id": rid,
                        "prompt": prompt,
                        "max_tokens": 30,
                        "endpoint": "chat",
                    }
                )
            send({"op": "admit", "seq": 10, "id": "a", "deadline_s": 5})
            assert (await frame())["instance"]["name"] == "d0"
            both = [
                {"op": "admit", "seq": 11, "id": "b", "deadline_s": 5},
                {"op": "end", "id": "b", "status": 499},
                {"op": "end", "id": "a", "status": 200},
                {"op": "ping", "seq": 12},
            ]
            writer.write(
                b"".join(
                    struct.pack("<I", len(b)) + b for b in map(str.encode, map(json.dumps, both))
                )
            )
            answer = await frame()
            assert answer["seq"] == 11 and "ended while it waited" in answer["error"]["message"]
            assert await frame() == {"seq": 12}
            c.assert_nothing_held()
            writer.close()
            await c.control.stop()
            assert not os.path.exists(path)
            c.assert_nothing_held()
            await c.services.client.aclose()

    asyncio.run(main())


def test_start_replaces_a_stale_socket() -> None:
    c = Cluster()

    async def main() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "control.sock")
            stale = socket.socket(socket.AF_UNIX)
            stale.bind(path)
            stale.close()
            await c.control.start(path)
            _, writer = await asyncio.open_unix_connection(path)
            writer.close()
            await c.control.stop()
            await c.services.client.aclose()

    asyncio.run(main())

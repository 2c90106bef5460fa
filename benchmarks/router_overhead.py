"""The router beside its peers: kvserve's router, sglang-router and vllm-router in front of
the same stand-in workers, and the same work done without a router, in one run.

Stand-in workers (benchmarks/router_standins.py, one process each for prefill and
decode) answer after the same delays in every protocol: the first token `--ttft-ms`
(20) after the call, then the other tokens streamed one per write. For each system and
mode (streamed SSE or one JSON body):

  direct   the client makes the worker calls of that system's protocol itself:
           kvserve: decode and prefill (await_landing) at once, DecodeReady forwarded
           to prefill as a LandingGrant, as the router does;
           sglang: /v1/completions to prefill and decode at once, decode's answer;
           vllm: prefill's /v1/completions (max_tokens 1), then decode's with its
           kv_transfer_params
  router   one OpenAI /v1/completions to the router

router minus direct is what the router adds. Each pair is measured sequentially
(`--sequential` requests on one connection: latency) and with `--concurrency` (64)
connections for `--seconds` each, in `--slices` (4) alternating slices of direct and
routed whose samples are pooled, so that the machine's drift falls on both (latency under
load and req/s); an unmeasured round of every path at load comes first (`--warmup-s`).
One client (router/http1.py's
keep-alive pool, uvloop) drives everything; the routers, the workers and the client share
the machine's cores. Correctness first: each router's text must equal the canned
tokens' text before anything is timed.

    python -m benchmarks.router_overhead [--systems kvserve kvserve-edge sglang-router
        vllm-router] [--kvserve-processes 1 2] [--edge-threads 0] [--concurrency 64]
        [--seconds 5] [--slices 4] [--warmup-s 2] [--sequential 300] [--out FILE.json]

`--kvserve-processes 1 2`: kvserve's router once as one process and once as two on one
port (router.processes, SO_REUSEPORT; the rows "kvserve-x2"); its CPU column is then the
sum over its processes.

`kvserve-edge`: kvserve's router with `router.data_plane: native` (docs/edge.md): the
Rust kvserve-edge serves the port and the Python router is its control plane; its CPU
column is the sum of both processes. `--edge-threads N` sets router.edge_threads.

sglang-router and vllm-router are installed once into their own virtual environments
(~/.cache/kvserve/, benchmarks/router_peers.py); not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil

from benchmarks.cpu_peer import cpu_model
from benchmarks.router_peers import PEERS
from benchmarks.router_table import TABLE_HEAD, medians, table_row
from protocol.messages import (
    PROTOCOL_VERSION,
    DecodeReady,
    DecodeRequest,
    FirstToken,
    LandingGrant,
    PrefillRequest,
    TokenBatch,
)
from protocol.sampling import SamplingParams
from router.http1 import Http1Pool

MODEL = "builtin:smollm2-135m-instruct"
SERVED = "smollm2-135m-instruct"
PROMPT = "Write one short sentence about caching."
OUTPUT_TEXT = " Caching keeps recent work close so the next request is fast."
NUM_OUTPUT_TOKENS = 12
SYSTEMS = ("kvserve", "kvserve-edge", "sglang-router", "vllm-router")
Call = Callable[[], Awaitable[bytes]]
"""A timed call: it returns once the last byte of the answer was read, the answer's bytes
unparsed (the client's own parsing of what the router answered is not the router's time;
`completion_text` and `kvserve_ids` read it in the correctness checks)."""


class Client:
    """Every path of one run over one keep-alive pool."""

    def __init__(self, pool: Http1Pool, prefill: str, decode: str, prompt_ids: list[int]) -> None:
        self.pool, self.prefill, self.decode, self.prompt_ids = pool, prefill, decode, prompt_ids
        self.params = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, temperature=0.0)
        self.count = 0

    async def post(self, url: str, body: bytes) -> bytes:
        resp = await self.pool.post(url, body)
        try:
            data = await resp.read()
        finally:
            resp.close()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:300]!r}")
        return data

    def openai_body(self, stream: bool, **extra: Any) -> dict[str, Any]:
        return {
            "model": SERVED,
            "prompt": PROMPT,
            "max_tokens": NUM_OUTPUT_TOKENS,
            "temperature": 0,
            "stream": stream,
            **extra,
        }

    async def via_router(self, url: str, stream: bool) -> bytes:
        return await self.post(
            url + "/v1/completions", json.dumps(self.openai_body(stream)).encode()
        )

    async def direct_kvserve(self) -> bytes:
        """What kvserve's router does (protocol 5): decode and prefill (await_landing) at
        once, decode's DecodeReady forwarded to prefill as a LandingGrant, then prefill's
        first token and decode's tokens: prefill's FirstToken line and decode's lines after
        DecodeReady, as read (`kvserve_ids` reads them)."""
        self.count += 1
        rid = f"bench-{self.count}"
        enc = msgspec.json.encode
        decode = DecodeRequest(PROTOCOL_VERSION, rid, self.prompt_ids, self.params)
        prefill = PrefillRequest(
            PROTOCOL_VERSION, rid, self.prompt_ids, self.params, [], "", await_landing=True
        )
        prefilled = asyncio.ensure_future(self.post(self.prefill + "/prefill", enc(prefill)))
        resp = await self.pool.post(self.decode + "/decode", enc(decode))
        try:
            buf = b""
            chunks = resp.chunks()
            async for chunk in chunks:
                buf += chunk
                if b"\n" in buf:
                    break
            head, _, buf = buf.partition(b"\n")
            ready = msgspec.json.decode(head, type=DecodeReady)
            grant = LandingGrant(PROTOCOL_VERSION, rid, ready.landing, ready.notify_url)
            await self.post(self.prefill + "/landing", enc(grant))
            first = await prefilled
            async for chunk in chunks:
                buf += chunk
        finally:
            resp.close()
            if not prefilled.done():
                prefilled.cancel()
        return first + buf

    async def direct_sglang(self, stream: bool) -> bytes:
        body = self.openai_body(
            stream, bootstrap_host="127.0.0.1", bootstrap_port=None, bootstrap_room=self.count
        )
        raw = json.dumps(body).encode()
        _, data = await asyncio.gather(
            self.post(self.prefill + "/v1/completions", raw),
            self.post(self.decode + "/v1/completions", raw),
        )
        return data

    async def direct_vllm(self, stream: bool) -> bytes:
        remote = {"do_remote_decode": True, "do_remote_prefill": False}
        first = self.openai_body(False, kv_transfer_params=remote)
        first.update(max_tokens=1, min_tokens=1)
        answer = json.loads(
            await self.post(self.prefill + "/v1/completions", json.dumps(first).encode())
        )
        body = self.openai_body(stream, kv_transfer_params=answer["kv_transfer_params"])
        return await self.post(self.decode + "/v1/completions", json.dumps(body).encode())


def kvserve_ids(data: bytes) -> str:
    """direct_kvserve's answer (FirstToken line, then TokenBatch lines): the ids, joined."""
    first, *rest = data.splitlines()
    ids = [msgspec.json.decode(first, type=FirstToken).token_id]
    for line in rest:
        ids += msgspec.json.decode(line, type=TokenBatch).token_ids
    return " ".join(map(str, ids))


def completion_text(data: bytes, stream: bool) -> str:
    if not stream:
        return str(json.loads(data)["choices"][0]["text"])
    text = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                text.append(choice.get("text") or "")
    return "".join(text)


# -- load ----------------------------------------------------------------------------------


def _pct(samples: list[float], q: float) -> float:
    return 1e3 * samples[min(len(samples) - 1, int(len(samples) * q))]


def _cpu_each(pids: Sequence[int]) -> list[tuple[float, float]]:
    """User and system CPU time of each of `pids` (all threads), seconds."""
    return [tuple(psutil.Process(pid).cpu_times()[:2]) for pid in pids]  # type: ignore[misc]


SETTLE_S = 0.25
"""Each later slice of a paired load phase starts after this long at load unmeasured
(the first after 1 s): the other path's requests drain and the loops reach pace."""


class _Tally:
    """Latency samples, wall time and CPU time (of `pids` and this client) summed over the
    timed slices of one path."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = [*pids, os.getpid()]
        self.samples: list[float] = []
        self.wall = 0.0
        self.cpu = [[0.0, 0.0] for _ in self.pids]

    async def run(self, fn: Call, concurrency: int, seconds: float, count: int | None) -> None:
        """`concurrency` closed loops for `seconds` (or until `count` samples in all)."""
        samples, end = self.samples, time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end and (count is None or len(samples) < count):
                t = time.perf_counter()
                await fn()
                samples.append(time.perf_counter() - t)

        start, before = time.perf_counter(), _cpu_each(self.pids)
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        self.wall += time.perf_counter() - start
        after = _cpu_each(self.pids)
        for acc, (u, s), (ue, se) in zip(self.cpu, before, after, strict=True):
            acc[0] += ue - u
            acc[1] += se - s

    def result(self) -> dict[str, Any]:
        """Latency percentiles (ms), req/s and CPU time per request: the processes' (user +
        system, all threads: what the router costs, whatever else runs) in all and each
        (`cpu_us_per_req_each`, in the order of `pids`), and the client's own (one core
        drives every path, so its load is part of what each path's latency includes)."""
        samples, n = sorted(self.samples), len(self.samples)
        each = [u + s for u, s in self.cpu[:-1]]
        client = sum(self.cpu[-1])
        return {
            "p50_ms": _pct(samples, 0.5),
            "p99_ms": _pct(samples, 0.99),
            "req_per_s": n / self.wall,
            "requests": n,
            "cpu_us_per_req": 1e6 * sum(each) / n,
            "cpu_us_per_req_each": [1e6 * c / n for c in each],
            "cpu_system_us_per_req": 1e6 * sum(s for _, s in self.cpu[:-1]) / n,
            "client_cpu_us_per_req": 1e6 * client / n,
        }


async def _warm(fn: Call, concurrency: int, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        await asyncio.gather(*(fn() for _ in range(concurrency)))


async def measure(
    fn: Call, concurrency: int, seconds: float, count: int | None, pids: Sequence[int] = ()
) -> dict[str, Any]:
    """One path: `concurrency` closed loops for `seconds` (or `count` requests in all)
    after a 1 s warm-up (`_Tally.result`)."""
    await _warm(fn, concurrency, 1.0)
    tally = _Tally(pids)
    await tally.run(fn, concurrency, seconds, count)
    return tally.result()


async def measure_pair(
    direct: Call,
    routed: Call,
    concurrency: int,
    seconds: float,
    slices: int,
    pids: Sequence[int],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both paths at load for `seconds` each, in `slices` alternating slices (direct,
    routed, then routed, direct, ...), samples pooled per path: the machine's drift over
    the phase (a neighbour, a host minutes after boot) falls on both alike instead of on
    whichever ran second. Each slice after the first starts after SETTLE_S at load."""
    tallies = {"direct": _Tally(()), "routed": _Tally(pids)}
    calls = {"direct": direct, "routed": routed}
    for i in range(slices):
        for label in ("direct", "routed") if i % 2 == 0 else ("routed", "direct"):
            await _warm(calls[label], concurrency, 1.0 if i == 0 else SETTLE_S)
            await tallies[label].run(calls[label], concurrency, seconds / slices, None)
    return tallies["direct"].result(), tallies["routed"].result()


# -- processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, proc: subprocess.Popen[bytes], path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, trust_env=False, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.2)


def serve_router(
    port: int,
    prefill_url: str,
    decode_url: str,
    quiet: bool = False,
    processes: int = 1,
    process_index: int = 0,
    metrics_port: int | None = None,
    model: str = MODEL,
    edge_threads: int | None = None,
) -> None:
    """`quiet`: health checks every 30 s and KV polls once an hour, so that what the
    router executes is nearly all the requests' work (benchmarks/router_instructions.py).
    `processes` > 1: this is process `process_index` of that many on `port` (the
    benchmark starts each, as router/processes.py would). `edge_threads` (not None):
    router.data_plane native with that many edge threads (0: one per core)."""
    from router.config import InstanceEndpoint, RouterSettings
    from router.server import run_router

    settings = RouterSettings(
        model=model,
        served_model_name=SERVED,
        port=port,
        prefill=(InstanceEndpoint(name="p0", url=prefill_url),),
        decode=(InstanceEndpoint(name="d0", url=decode_url),),
        processes=processes,
        process_index=process_index,
        metrics_port=metrics_port,
        data_plane="python" if edge_threads is None else "native",
        edge_threads=edge_threads or 0,
    )
    if quiet:
        settings = msgspec.structs.replace(
            settings, health_interval_s=30.0, kv_poll_interval_s=3600.0
        )
    run_router(settings, log_level="warning")


def process_env(router_path: str | None = None) -> dict[str, str]:
    """The environment of the processes a benchmark starts: this repository on PYTHONPATH,
    after `router_path` when given (a directory holding another build of router/ to measure
    instead of the repository's own, e.g. a compiled one: benchmarks/router_mypyc.py)."""
    root = str(Path(__file__).resolve().parent.parent)
    paths = [root] if router_path is None else [router_path, root]
    if os.environ.get("PYTHONPATH"):  # the caller's own packages (e.g. wheels in a target dir)
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from modelinfo.info import load_model_info

    tokenizer = load_model_info(args.model).tokenizer
    tokens = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:NUM_OUTPUT_TOKENS]
    expected = tokenizer.decode(tokens)
    pieces = [
        tokenizer.decode(tokens[: i + 1])[len(tokenizer.decode(tokens[:i])) :]
        for i in range(len(tokens))
    ]
    systems = [
        *(k for name in args.systems for k in _kvserve_systems(name, args.kvserve_processes)),
    ]
    ports = {k: _free_port() for k in ("prefill", "decode", *systems)}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    env = process_env(args.router_path)
    # -P: modules from PYTHONPATH only (process_env), not from the working directory first.
    me = [sys.executable, "-P", "-m", "benchmarks.router_overhead"]
    canned = json.dumps({"tokens": tokens, "pieces": pieces, "ttft_s": args.ttft_ms / 1e3})
    procs: dict[str, subprocess.Popen[bytes]] = {}
    router_pids: dict[str, list[int]] = {}
    metrics_urls: dict[str, str] = {}
    for role in ("prefill", "decode"):
        procs[role] = subprocess.Popen(
            [*me, "--serve-worker", role, str(ports[role]), canned], env=env
        )
    try:
        for role in ("prefill", "decode"):
            _wait_up(url[role], procs[role], "/health")
        for name in systems:
            if name.startswith("kvserve"):
                num = _num_processes(name)
                cmd = [*me, "--serve-router", str(ports[name]), url["prefill"], url["decode"]]
                cmd.append(f"--model={args.model}")
                if name == "kvserve-edge":
                    cmd.append(f"--edge-threads={args.edge_threads}")
                metrics = _free_port()
                for i in range(num):
                    key = name if i == 0 else f"{name}/{i}"
                    argv = [*cmd, f"--process={i}/{num}", f"--metrics-port={metrics}"]
                    procs[key] = subprocess.Popen(argv, env=env)
                    router_pids.setdefault(name, []).append(procs[key].pid)
                    # Each process's own metrics port answers once it has loaded.
                    metrics_urls[key] = f"http://127.0.0.1:{metrics + i}"
            else:
                peer = PEERS[name]
                cmd = peer.command(
                    peer.ensure(args.peer_wheels),
                    ports[name],
                    _free_port(),
                    url["prefill"],
                    url["decode"],
                )
                procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
                router_pids[name] = [procs[name].pid]
        pool = Http1Pool(connect_timeout_s=5.0)
        client = Client(pool, url["prefill"], url["decode"], tokenizer.encode(PROMPT))
        for name in systems:
            _wait_up(url[name], procs[name], "/health")
            if name == "kvserve-edge":  # the edge is the router's child: count both
                children = psutil.Process(procs[name].pid).children(recursive=True)
                router_pids[name] += [c.pid for c in children]
        for key, metrics_url in metrics_urls.items():
            _wait_up(metrics_url, procs[key], "/metrics")
        for name in systems:  # correctness before speed: every router, both modes
            for stream in (False, True):
                text = completion_text(await client.via_router(url[name], stream), stream)
                assert text == expected, (name, stream, text, expected)
        assert kvserve_ids(await client.direct_kvserve()) == " ".join(map(str, tokens))
        for stream in (False, True):
            if "sglang-router" in systems:
                text = completion_text(await client.direct_sglang(stream), stream)
                assert text == expected, ("sglang direct", stream, text)
            if "vllm-router" in systems:
                text = completion_text(await client.direct_vllm(stream), stream)
                assert text == expected, ("vllm direct", stream, text)
        result: dict[str, Any] = {
            "output_tokens": len(tokens),
            "ttft_ms": args.ttft_ms,
            "repeats": args.repeats,
            "rows": [],
        }

        def direct_call(name: str, stream: bool) -> Call:
            return functools.partial(
                {
                    "kvserve": lambda _s: client.direct_kvserve(),
                    "sglang-router": client.direct_sglang,
                    "vllm-router": client.direct_vllm,
                }["kvserve" if name.startswith("kvserve") else name],
                stream,
            )

        def routed_call(name: str, stream: bool) -> Call:
            return functools.partial(client.via_router, url[name], stream)

        # One unmeasured round first: every path at load for --warmup-s. Without it the
        # first streamed phase through kvserve's routers ran 0.3-1.9 ms slower than the
        # later ones, at one connection and at 64, whichever of the two routers it was
        # (docs/benchmarks.md, run 5; the cause was not established).
        for name in systems if args.warmup_s > 0 else ():
            for stream in (False, True):
                for fn in (direct_call(name, stream), routed_call(name, stream)):
                    await _warm(fn, args.concurrency, args.warmup_s)
        # Rounds interleave the systems, so that a slow minute of the machine falls on
        # every router alike rather than on one.
        rounds = [(r, n, s) for r in range(args.repeats) for n in systems for s in (False, True)]
        for repeat, name, stream in rounds:
            direct, routed = direct_call(name, stream), routed_call(name, stream)
            row: dict[str, Any] = {"system": name, "stream": stream, "repeat": repeat}
            for label, fn, pids in (
                ("direct", direct, []),
                ("router", routed, router_pids[name]),
            ):
                row[f"{label}_seq"] = await measure(fn, 1, 60.0, args.sequential, pids)
            row["direct_load"], row["router_load"] = await measure_pair(
                direct, routed, args.concurrency, args.seconds, args.slices, router_pids[name]
            )
            for phase in ("seq", "load"):
                r, d = row[f"router_{phase}"], row[f"direct_{phase}"]
                row[f"added_{phase}_p50_ms"] = r["p50_ms"] - d["p50_ms"]
                row[f"added_{phase}_p99_ms"] = r["p99_ms"] - d["p99_ms"]
            print(table_row(row), file=sys.stderr, flush=True)
            load = row["router_load"]
            each = load["cpu_us_per_req_each"]
            labels = (
                ["control plane", *(["edge"] * (len(each) - 1))]
                if name == "kvserve-edge"
                else [f"process {i}" for i in range(len(each))]
            )
            parts = ", ".join(f"{n} {c:,.0f}" for n, c in zip(labels, each, strict=True))
            client_cpu = f"client {load['client_cpu_us_per_req']:,.0f} through the router, " + (
                f"{row['direct_load']['client_cpu_us_per_req']:,.0f} direct"
            )
            print(
                f"    CPU µs/req at {args.concurrency}: {parts}; {client_cpu}",
                file=sys.stderr,
                flush=True,
            )
            result["rows"].append(row)
        result["medians"] = medians(result["rows"])
        pool.close()
        return result
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _kvserve_systems(name: str, processes: Sequence[int]) -> list[str]:
    """kvserve's router once per process count: "kvserve", "kvserve-x2", ... (the edge
    runs as one router process: its threads are set apart)."""
    if name != "kvserve":
        return [name]
    return [name if n == 1 else f"{name}-x{n}" for n in processes]


def _num_processes(name: str) -> int:
    _, _, num = name.partition("-x")
    return int(num) if num else 1


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-worker":
        from benchmarks.router_standins import serve

        canned = json.loads(sys.argv[4])
        serve(sys.argv[2], int(sys.argv[3]), canned["tokens"], canned["pieces"], canned["ttft_s"])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-router":
        index, num, metrics, model, edge_threads = 0, 1, None, MODEL, None
        for arg in sys.argv[5:]:
            if arg.startswith("--model="):
                model = arg.removeprefix("--model=")
            if arg.startswith("--process="):
                index, num = map(int, arg.removeprefix("--process=").split("/"))
            if arg.startswith("--metrics-port="):
                metrics = int(arg.removeprefix("--metrics-port="))
            if arg.startswith("--edge-threads="):
                edge_threads = int(arg.removeprefix("--edge-threads="))
        quiet = "--quiet" in sys.argv[5:]
        serve_router(
            int(sys.argv[2]),
            sys.argv[3],
            sys.argv[4],
            quiet,
            num,
            index,
            metrics,
            model,
            edge_threads,
        )
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--kvserve-processes",
        type=int,
        nargs="+",
        default=[1],
        help="kvserve's router once per count of router processes (router.processes)",
    )
    parser.add_argument(
        "--edge-threads",
        type=int,
        default=0,
        help="kvserve-edge: router.edge_threads (0: one per core)",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="load phase per path")
    parser.add_argument("--sequential", type=int, default=300, help="requests on one connection")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument(
        "--slices",
        type=int,
        default=4,
        help="the load phase of a row as this many alternating slices of direct and routed",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=2.0,
        help="an unmeasured round first: every path at --concurrency for this long (0: none)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over every system and mode, interleaved; medians printed at the end",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--model",
        default=MODEL,
        help="the model whose tokenizer the routers use: a spec or a Hugging Face folder "
        "(benchmarks/tokenizer_folder.py writes one without weights)",
    )
    parser.add_argument(
        "--peer-wheels",
        default=None,
        help="install sglang-router / vllm-router from this folder of wheels (no index), "
        "for a machine without a package registry",
    )
    parser.add_argument(
        "--router-path",
        default=None,
        help="a directory with another build of router/, imported before the repository's",
    )
    args = parser.parse_args()
    if args.slices < 1:
        parser.error(f"--slices must be at least 1, got {args.slices}")
    import uvloop

    result = uvloop.run(run(args))
    result["machine"] = f"{cpu_model()}, {os.cpu_count()} cores"
    result["command"] = " ".join(["python -m benchmarks.router_overhead", *sys.argv[1:]])
    print(json.dumps(result, indent=2))
    print(TABLE_HEAD)
    for row in result["rows"]:
        print(table_row(row))
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} interleaved rounds:\n{TABLE_HEAD}")
        for row in result["medians"]:
            print(table_row(row))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Instructions the router executes per request, counted by valgrind's callgrind.

Wall time and CPU time on a shared 2-core box move with whatever else runs; the count
of instructions does not. The router (benchmarks/router_overhead.py's, in front of the
same stand-in workers) runs under `valgrind --tool=callgrind`; one client sends
`--warmup` requests on one keep-alive connection, the counters are zeroed
(`callgrind_control -z`), `--requests` more follow, and the counters are dumped
(`callgrind_control -d`): their total over `--requests` is the router's cost per
request, startup and warm-up excluded. The router's periodic health checks (every 30
s) and KV polls (hourly) are made rare: they cost instructions per second of wall time,
and the wall time under valgrind moves with the machine's load. What still runs per
second whatever the requests (uvicorn's ticks, timers: ~1-2 M instructions a second under
valgrind) is measured after the count, the router idle for `--idle-s`, and the second
figure printed takes that rate over the counted phase's wall time off: runs of the same
code whose wall times differ (a loaded machine) agree better on it.

    python -m benchmarks.router_instructions [--stream] [--chat] [--requests 200]
        [--warmup 30] [--concurrency 1] [--idle-s 10] [--router-path DIR]

`--chat`: /v1/chat/completions with the prompt as one user message (the chat template
rendered per request) instead of /v1/completions. `--distinct`: every request's prompt
ends with its own number, so that nothing of the prompt's text but the template's is
seen twice (the router remembers a chat prompt's pieces between special tokens:
router/prompt_tokens.py).
`--router-path DIR`: the router imports router/ from DIR (another build of it, such as
benchmarks/router_mypyc.py's compiled one) instead of this repository's.

Slow (the router runs ~50x slower under valgrind): a few minutes. Not run in CI. With
`--concurrency` above 1 on a loaded machine, the router's health checks (1 s timeout)
may time out under valgrind and mark a worker down for 30 s: such requests are sent
again after the worker is healthy, and counted in `retried_after_503` (a run with many
is not a clean count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.router_overhead import (
    MODEL,
    NUM_OUTPUT_TOKENS,
    OUTPUT_TEXT,
    Client,
    _free_port,
    _wait_up,
    completion_text,
    process_env,
)
from router.http1 import Http1Pool

RETRIED = [0]
"""Requests answered 503 (a worker marked down by a health check that timed out under
valgrind) and sent again: reported, as they add a little to the count."""


def _callgrind_control(flag: str, pid: int) -> None:
    subprocess.run(
        ["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=120
    )


def _total(out_dir: str, pid: int, dump: int = 1) -> int:
    """Instructions in dump number `dump` of `pid` (`callgrind_control -d`), not in the
    one written when the process ends: its `summary:` line.

    `summary:` is what every thread executed since the last zero or dump (callgrind sums
    each thread's running count less its count at that point). `totals:`, the sum of the
    dump's cost lines, is not that: the cost of a call through a PLT stub is kept at its
    call site as "skipped" cost, which `callgrind_control -z` leaves in place and only a
    dump clears, so with callgrind's default --skip-plt=yes the first dump's totals also
    held every such call since the process started (the router's start-up and warm-up:
    ~56 M instructions, +26% over 200 requests). A Python loop under callgrind shows it:
    the same counted work after 0, 4,000 or 16,000 iterations before the zero gave the
    same summary (58.9-59.0 M) and totals 1.0, 4.3 and 14.2 M above it; with
    --skip-plt=no the two are equal. The router runs with --skip-plt=no (`run`), so the
    dump's cost lines (callgrind_annotate) hold the counted phase alone as well.
    """
    text = Path(f"{out_dir}/callgrind.out.{pid}.{dump}").read_text(errors="replace")
    match = re.search(r"^summary:\s+(\d+)", text, re.M)
    assert match is not None, f"no summary line in the dump of {pid}"
    return int(match.group(1))


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """Until the router's health checks found every worker up (a check that timed out
    under valgrind's slowness is repeated 30 s later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        resp = httpx.get(url + "/health", trust_env=False, timeout=30)
        body = resp.json() if resp.status_code == 200 else {}
        if body and all(body[r]["healthy"] == body[r]["total"] for r in ("prefill", "decode")):
            return
        time.sleep(1.0)
    raise RuntimeError("the router's workers did not become healthy")


@dataclass(frozen=True)
class Load:
    """What every request of a run sends and expects."""

    client: Client
    url: str
    stream: bool
    expected: str
    proc: subprocess.Popen[bytes]
    chat: bool = False
    distinct: bool = False


async def _requests(load: Load, count: int, concurrency: int = 1) -> None:
    """`count` requests in all from `concurrency` closed loops."""
    share = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(_loop(load, n) for n in share if n))


def chat_text(data: bytes, stream: bool) -> str:
    """The assistant's text of a chat completion, whole or streamed."""
    if not stream:
        return str(json.loads(data)["choices"][0]["message"]["content"])
    text = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def _loop(load: Load, count: int) -> None:
    client, url, stream, chat, distinct = (
        load.client,
        load.url,
        load.stream,
        load.chat,
        load.distinct,
    )
    path = "/v1/chat/completions" if chat else "/v1/completions"
    done = 0
    body = b""
    while done < count:
        if distinct or not body:
            fields = client.openai_body(stream)
            if distinct:
                client.count += 1
                fields["prompt"] += f" ({client.count})"
            if chat:
                fields["messages"] = [{"role": "user", "content": fields.pop("prompt")}]
            body = json.dumps(fields).encode()
        try:
            data = await client.post(url + path, body)
        except RuntimeError as e:
            # A health check that timed out under valgrind marks a worker down until the
            # next one: wait for it, then go on (a 503 costs the router little).
            if "HTTP 503" not in str(e):
                raise
            RETRIED[0] += 1
            await asyncio.to_thread(_wait_healthy, url, load.proc)
            continue
        text = chat_text(data, stream) if chat else completion_text(data, stream)
        assert text == load.expected, (text, load.expected)
        done += 1


async def run(
    args: argparse.Namespace, router_module: str = "benchmarks.router_overhead"
) -> dict[str, object]:
    """`router_module`: the module whose `--serve-router` runs the router under valgrind
    (benchmarks/router_phases.py's wraps the router's functions first)."""
    from modelinfo.info import load_model_info

    tokenizer = load_model_info(MODEL).tokenizer
    tokens = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:NUM_OUTPUT_TOKENS]
    pieces = [
        tokenizer.decode(tokens[: i + 1])[len(tokenizer.decode(tokens[:i])) :]
        for i in range(len(tokens))
    ]
    ports = {k: _free_port() for k in ("prefill", "decode", "router")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    env = process_env(args.router_path)
    # -P: modules from PYTHONPATH only (process_env), not from the working directory first.
    me = [sys.executable, "-P", "-m", "benchmarks.router_overhead"]
    canned = json.dumps({"tokens": tokens, "pieces": pieces, "ttft_s": args.ttft_ms / 1e3})
    out_dir = tempfile.mkdtemp(prefix="router-callgrind-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role in ("prefill", "decode"):
            procs.append(
                subprocess.Popen([*me, "--serve-worker", role, str(ports[role]), canned], env=env)
            )
        for role, proc in zip(("prefill", "decode"), procs, strict=True):
            _wait_up(url[role], proc, "/health")
        router = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--skip-plt=no",  # the dump's cost lines: the counted phase only (_total)
                f"--callgrind-out-file={out_dir}/callgrind.out.%p",
                *me[:-1],
                router_module,
                "--serve-router",
                str(ports["router"]),
                url["prefill"],
                url["decode"],
                "--quiet",  # no health checks or KV polls: their count grows with wall time
            ],
            env=env,
            stderr=open(f"{out_dir}/router.log", "wb"),  # noqa: SIM115 (the child owns it)
        )
        procs.append(router)
        _wait_up(url["router"], router, "/health", timeout_s=900)
        _wait_healthy(url["router"], router)
        pool = Http1Pool(connect_timeout_s=30.0)
        client = Client(pool, url["prefill"], url["decode"], tokenizer.encode("x"))
        load = Load(
            client,
            url["router"],
            args.stream,
            tokenizer.decode(tokens),
            router,
            args.chat,
            args.distinct,
        )
        start = 0.0
        for counted, count in ((False, args.warmup), (True, args.requests)):
            if counted:
                _callgrind_control("-z", router.pid)
                start = time.monotonic()
            await _requests(load, count, args.concurrency)
        wall = time.monotonic() - start
        _callgrind_control("-d", router.pid)
        # The same router idle for --idle-s: what it runs per second with no request
        # (uvicorn's ticks, timers), which the counted phase also ran for its wall time.
        _callgrind_control("-z", router.pid)
        idle_start = time.monotonic()
        await asyncio.sleep(args.idle_s)
        _callgrind_control("-d", router.pid)
        idle_wall = time.monotonic() - idle_start
        pool.close()
        total = _total(out_dir, router.pid)
        idle_rate = _total(out_dir, router.pid, 2) / idle_wall
        return {
            "stream": args.stream,
            "chat": args.chat,
            "distinct": args.distinct,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "instructions": total,
            "instructions_per_request": total / args.requests,
            "idle_instructions_per_s": idle_rate,
            "instructions_per_request_less_idle": (total - idle_rate * wall) / args.requests,
            "retried_after_503": RETRIED[0],
            "wall_s_under_valgrind": wall,
            "dump_dir": out_dir,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stream", action="store_true", help="SSE instead of one JSON body")
    parser.add_argument(
        "--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions"
    )
    parser.add_argument(
        "--distinct", action="store_true", help="a prompt of its own for every request"
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--concurrency", type=int, default=1, help="closed loops (connections) at once"
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="idle phase that measures the per-second rate"
    )
    parser.add_argument(
        "--router-path",
        default=None,
        help="a directory with another build of router/, imported before the repository's",
    )
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(run(args))
    print(json.dumps(result, indent=2))
    print(f"{result['instructions_per_request'] / 1e6:.3f} M instructions per request")  # type: ignore[operator]
    less_idle = result["instructions_per_request_less_idle"]
    print(f"{less_idle / 1e6:.3f} M less the idle rate over the counted wall time")  # type: ignore[operator]


if __name__ == "__main__":
    main()

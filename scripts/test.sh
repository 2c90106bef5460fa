#!/usr/bin/env bash
# Every check CI runs: lint, format, types, layering contracts, tests. Uses the virtual
# environment scripts/setup.sh made (./.venv) unless one is active already.
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
python -m pytest -q "$@"

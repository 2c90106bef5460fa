#!/usr/bin/env bash
# Every check CI runs: lint, format, types, layering contracts, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
lint-imports
python -m pytest -q "$@"

#!/usr/bin/env bash
# Set up .venv if missing, lint, and run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/ruff check sbp tests examples benchmarks
.venv/bin/ruff format --check sbp tests examples benchmarks
exec .venv/bin/python -m pytest -q "$@"

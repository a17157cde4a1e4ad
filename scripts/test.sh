#!/usr/bin/env bash
# Set up (once), then run the linter and the default test suite (real multi-process runs, under 10 min on 2 cores;
# `-m slow` runs the long ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"

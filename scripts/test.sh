#!/usr/bin/env bash
# Set up (once), then run the linter and the whole test suite (real multi-process runs, ~3 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"

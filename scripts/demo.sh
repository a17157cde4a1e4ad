#!/usr/bin/env bash
# Set up (once), then run the fire drill: 3 CPU ranks, rank 1 simulated faulty, detection printed.
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --fault weights --faulty-rank 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHONWARNINGS=ignore exec .venv/bin/python examples/lightning_ddp_demo.py "$@"

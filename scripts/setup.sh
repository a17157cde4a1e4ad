#!/usr/bin/env bash
# Set up .venv with torch (CPU build, pinned) and this project with its test extras. Idempotent.
# torch is pinned to 2.13.0 so pip never pulls a newer, multi-GB CUDA build. Where the CPU wheel
# is not the default (plain PyPI on Linux x86-64), point SDC_TORCH_INDEX at a CPU index, e.g.
#   SDC_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
if ! "$py" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0" ${SDC_TORCH_INDEX:+--index-url "$SDC_TORCH_INDEX"}
fi
"$py" -m pip install -q -e ".[test]"

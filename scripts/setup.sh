#!/usr/bin/env bash
# Set up .venv with torch (CPU build, pinned) and this project with its test extras. Idempotent, and
# quick when nothing changed: the project is (re)installed only when .venv/.sdc-installed does not
# match pyproject.toml (or the package does not import), torch only when its version is not the pin.
# torch is pinned to 2.13.0 so pip never pulls a newer, multi-GB CUDA build. Where the CPU wheel
# is not the default (plain PyPI on Linux x86-64), point SDC_TORCH_INDEX at a CPU index, e.g.
#   SDC_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
stamp=.venv/.sdc-installed
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no round trip to the index to ask whether pip itself is the newest
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "setup: installing torch 2.13.0 into .venv" >&2
  "$py" -m pip install -q "torch==2.13.0" ${SDC_TORCH_INDEX:+--index-url "$SDC_TORCH_INDEX"}
  rm -f "$stamp"
fi
want="$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest(), sys.version.split()[0])')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$py" -c 'import importlib.metadata as m, sdc_core.cli; m.version("sdc-checks")' 2>/dev/null; then
  echo "setup: installing sdc-checks and its test extras into .venv" >&2
  "$py" -m pip install -q -e ".[test]"
  printf '%s\n' "$want" > "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
fi
bash scripts/slurm_setup.sh   # Slurm for tests/test_slurm.py, where missing (root + apt-get only)

#!/usr/bin/env bash
# End-to-end check on a machine with 2+ CUDA devices: Accelerate's FSDP2 plugin (fsdp_version=2)
# with the SDC hooks; each fault must name its rank, the clean run must raise nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
[ "$n" -ge 2 ] || { echo "needs 2+ CUDA devices, found $n"; exit 2; }
for fault in nan at_rest compute none; do
  PYTHONPATH=$PWD accelerate launch --num_processes "$n" benchmarks/fsdp2_accelerate_e2e.py --fault "$fault"
done

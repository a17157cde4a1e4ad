#!/usr/bin/env bash
# GPU benchmark: kernels (fingerprint and non-finite check bandwidth against sum, SHA-1 of host
# bytes, hash_tensor and the device's own copy bandwidth) and the transformer step, on one CUDA
# device. One short run (a few minutes on an H100/H200); results in $OUT (or benchmarks/results/) as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
PYTHONWARNINGS=ignore python3 -m benchmarks --device cuda --sections kernels,step --out "$out/performance-gpu.json"

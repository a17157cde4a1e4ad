#!/usr/bin/env bash
# The GPU checks in one call (one GPU, a few minutes): the GPU test suite, then the GPU benchmark.
#   bash scripts/gpu_check.sh [OUT_DIR]     (default: gpu-results/)
# Uses the python3 that has torch with CUDA (no venv, no install: the machine may reach no registry).
# Writes OUT_DIR/gpu_suite.log, gpu_replay.log (+ gpu_replay.json), gpu_step.json and gpu_bench.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$out/machine.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/machine.txt"
suite=0
timeout "${SDC_GPU_SUITE_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" -rs \
  tests/test_gpu.py tests/test_fingerprint_batched.py tests/test_device_paths_unit.py tests/test_replay_copies.py \
  2>&1 | tee "$out/gpu_suite.log" || suite=$?
replay=0
if [ "${SDC_GPU_REPLAY:-1}" = 1 ]; then  # the ring replay's modes on nondeterministic GPU kernels (3 ranks, one GPU)
  OUT="$out" timeout "${SDC_GPU_REPLAY_TIMEOUT:-150}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node 3 tests/gpu_replay_check.py 2>&1 | tee "$out/gpu_replay.log" || replay=$?
fi
bench=0
if [ "${SDC_GPU_BENCH:-1}" = 1 ]; then
  timeout "${SDC_GPU_BENCH_TIMEOUT:-200}" python3 -m benchmarks.gpu_step --out "$out/gpu_step.json" 2>&1 \
    | tee "$out/gpu_bench.log" || bench=$?
fi
echo "gpu suite exit $suite, replay check exit $replay, benchmark exit $bench" | tee -a "$out/machine.txt"
[ "$suite" = 0 ] && [ "$replay" = 0 ] && [ "$bench" = 0 ]

#!/usr/bin/env bash
# The GPU checks in one call (one GPU, a few minutes): the GPU test suite, then the GPU benchmark.
#   bash scripts/gpu_check.sh [OUT_DIR]     (default: gpu-results/)
# Uses the python3 that has torch with CUDA (no venv, no install: the machine may reach no registry).
# Writes OUT_DIR/gpu_suite.log, gpu_replay.log (+ gpu_replay.json), memory*.json (+ gpu_memory.log), gpu_step.json
# and gpu_bench.log.
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
memory=0
if [ "${SDC_GPU_MEMORY:-1}" = 1 ]; then  # peak device memory of clean and audited steps (2 ranks on the GPU over gloo)
  for view in "" "--bucket-view"; do
    timeout "${SDC_GPU_MEMORY_TIMEOUT:-90}" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m benchmarks.memory --device cuda --spec 1024,12,16,32000 --batch 8 --seq 512 --configs none,defaults,audited \
      $view --out "$out/memory${view:+-bucket-view}.json" 2>&1 | tee -a "$out/gpu_memory.log" || memory=$?
  done
fi
bench=0
if [ "${SDC_GPU_BENCH:-1}" = 1 ]; then
  timeout "${SDC_GPU_BENCH_TIMEOUT:-200}" python3 -m benchmarks.gpu_step --out "$out/gpu_step.json" 2>&1 \
    | tee "$out/gpu_bench.log" || bench=$?
fi
echo "gpu suite exit $suite, replay check exit $replay, memory exit $memory, benchmark exit $bench" | tee -a "$out/machine.txt"
[ "$suite" = 0 ] && [ "$replay" = 0 ] && [ "$memory" = 0 ] && [ "$bench" = 0 ]

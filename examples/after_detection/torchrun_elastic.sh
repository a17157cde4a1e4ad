#!/usr/bin/env bash
# torchrun elastic: restart the worker group after an SDC verdict, without the host it named.
# Each node runs this; RDZV_ENDPOINT is the rendezvous host:port. The script (not torchrun) decides
# whether this node may rejoin: a node named faulty exits, the others restart from the checkpoint.
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/elastic}
while true; do
  torchrun --nnodes=1:4 --nproc-per-node="${NPROC:-8}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:?}" --rdzv-id="${JOB_ID:-sdc}" --max-restarts=0 \
    train.py --run-dir "$RUN_DIR" "$@"
  code=$?
  [ "$code" -eq "${SDC_EXIT_CODE:-86}" ] || exit "$code"      # a clean finish or a real crash
  if sdc exclude-list "$RUN_DIR" --format lines | grep -qx "$(hostname)"; then
    echo "this host was named faulty by an SDC check: leaving the job" >&2
    exit "$code"
  fi
  sleep 10                                                     # let the others see the smaller group
done

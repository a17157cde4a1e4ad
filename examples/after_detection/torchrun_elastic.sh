#!/usr/bin/env bash
# torchrun elastic: restart the worker group after an SDC verdict, without the host it named.
# Each node runs this; RDZV_ENDPOINT is the rendezvous host:port; RUN_DIR is on shared storage.
# torchrun alone exits 1 for any failed worker; inside `sdc run` the job exits 86 when it ended
# on an SDC verdict (every other code is kept). The script, not torchrun, decides whether this
# node may rejoin: a node named faulty leaves, the others restart (from the checkpoint) as a
# smaller group. --max-restarts=0: torchrun's own restarts cannot leave a host out (inside
# `sdc run` a worker group restarted after a verdict would end at once with 86 anyway).
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/elastic}
while true; do
  sdc run -- torchrun --nnodes=1:4 --nproc-per-node="${NPROC:-8}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:?}" --rdzv-id="${JOB_ID:-sdc}" --max-restarts=0 \
    train.py --run-dir "$RUN_DIR" "$@"
  code=$?
  [ "$code" -eq "${SDC_EXIT_CODE:-86}" ] || exit "$code"      # a clean finish or a real crash
  if sdc exclude-list "$RUN_DIR" --format lines | grep -qx "$(sdc node-name)"; then  # as the ranks recorded it
    echo "this node was named faulty by an SDC check: leaving the job" >&2
    exit "$code"
  fi
  sleep 10                                                     # let the others see the smaller group
done

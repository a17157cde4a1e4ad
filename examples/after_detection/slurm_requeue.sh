#!/usr/bin/env bash
# Slurm: run training; on an SDC verdict (exit code 86) drain the nodes it named and requeue the
# job: it starts again without them and resumes from its last checkpoint (train.py resumes from
# the newest one in RUN_DIR; every checkpoint was written after the replicas were compared).
#   sbatch examples/after_detection/slurm_requeue.sh [train.py options]
# One torchrun agent per node, each inside `sdc run`: torchrun alone exits 1 for any failed
# worker, `sdc run` exits 86 when the job ended on an SDC verdict and keeps every other code.
# srun --kill-on-bad-exit=0 returns the highest exit code of its tasks, so 86 reaches this script
# (with =1 srun kills the other tasks and returns 143). Incidents name nodes as Slurm does
# (SLURMD_NODENAME), so the faulty node is the one drained even where nodes share a host name;
# the reason names the check, the step and the job (`sinfo -R`, `scontrol show node NODE`).
#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --requeue --open-mode=append
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID}                   # on shared storage; a requeued job keeps its id
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
ADDR=$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)   # where HEAD is reached
srun --kill-on-bad-exit=0 sdc run -- torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="${NPROC:-8}" \
  --rdzv-backend=c10d --rdzv-endpoint="${ADDR:-$HEAD}:${RDZV_PORT:-29500}" --rdzv-id="$SLURM_JOB_ID" \
  train.py --run-dir "$RUN_DIR" "$@"
code=$?
echo "sdc: job $SLURM_JOB_ID (attempt ${SLURM_RESTART_COUNT:-0}, nodes $SLURM_JOB_NODELIST): training ended with $code"
if [ "$code" -eq "${SDC_EXIT_CODE:-86}" ]; then
  sdc report "$RUN_DIR"
  bad=$(sdc exclude-list "$RUN_DIR")                     # e.g. node-b,node-f (empty: not localized)
  if [ -n "$bad" ]; then                                 # a drained node takes no job: the requeued one avoids it
    scontrol update NodeName="$bad" State=DRAIN Reason="$(sdc exclude-list "$RUN_DIR" --format reason), job $SLURM_JOB_ID"
  fi
  # With RequeueExit=86 in slurm.conf Slurm requeues a job that exits 86 itself (its record keeps
  # the code); otherwise ask for it (the requeue ends this script).
  scontrol show config | grep -Eq "^RequeueExit +=.*\b${SDC_EXIT_CODE:-86}\b" || scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"

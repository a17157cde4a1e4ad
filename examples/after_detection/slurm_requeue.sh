#!/usr/bin/env bash
# Slurm: run training; on an SDC verdict (exit code 86) drain the named nodes and requeue the job
# excluding them. Submit with: sbatch --requeue examples/after_detection/slurm_requeue.sh
# One torchrun agent per node, each inside `sdc run`: torchrun alone exits 1 for any failed
# worker, `sdc run` exits 86 when the job ended on an SDC verdict and keeps every other code.
# srun returns the highest exit code of its tasks, so 86 reaches this script.
#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --requeue --open-mode=append
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID}                   # on shared storage: every node writes there
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun --kill-on-bad-exit=0 sdc run -- torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="${NPROC:-8}" \
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD:29500" --rdzv-id="$SLURM_JOB_ID" \
  train.py --run-dir "$RUN_DIR" "$@"
code=$?
if [ "$code" -eq "${SDC_EXIT_CODE:-86}" ]; then
  bad=$(sdc exclude-list "$RUN_DIR")                     # e.g. node-b,node-f (empty: not localized)
  if [ -n "$bad" ]; then
    scontrol update NodeName="$bad" State=DRAIN Reason="SDC verdict, job $SLURM_JOB_ID"
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$bad"
  fi
  sdc report "$RUN_DIR"
  scontrol requeue "$SLURM_JOB_ID"                       # resumes from the last checkpoint
fi
exit "$code"

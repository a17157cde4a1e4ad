#!/usr/bin/env bash
# Slurm: run training; on an SDC verdict (exit code 86) drain the named nodes and requeue the job
# excluding them. Submit with: sbatch --requeue examples/after_detection/slurm_requeue.sh
#SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --requeue --open-mode=append
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID}
srun python train.py --run-dir "$RUN_DIR" "$@"
code=$?
if [ "$code" -eq "${SDC_EXIT_CODE:-86}" ]; then
  bad=$(sdc exclude-list "$RUN_DIR")                     # e.g. node-b,node-f
  if [ -n "$bad" ]; then
    scontrol update NodeName="$bad" State=DRAIN Reason="SDC verdict, job $SLURM_JOB_ID"
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$bad"
  fi
  sdc report "$RUN_DIR"
  scontrol requeue "$SLURM_JOB_ID"                       # resumes from the last checkpoint
fi
exit "$code"

#!/usr/bin/env bash
# Slurm, Lightning without torchrun: srun starts one task per device and Lightning's own
# SLURMEnvironment takes ranks from Slurm (train.py builds Trainer(num_nodes=SLURM_NNODES,
# devices=<tasks per node>) with the lightning_sdc callbacks); each task runs inside `sdc run`,
# which exits 86 when the job ended on an SDC verdict. On 86: the nodes the verdict named are
# drained (the reason names the check, the step and the job) and the job is requeued; it starts
# again without them and resumes from the newest checkpoint verified clean (see slurm_requeue.sh).
#   sbatch examples/after_detection/slurm_lightning.sh [train.py options]
#SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --requeue --open-mode=append
set -uo pipefail
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID}                   # on shared storage; a requeued job keeps its id
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
ADDR=$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
export MASTER_ADDR=${MASTER_ADDR:-${ADDR:-$HEAD}}          # Lightning would take the node's name as its address
srun --kill-on-bad-exit=0 sdc run -- "${PYTHON:-python}" train.py --run-dir "$RUN_DIR" "$@"
code=$?
echo "sdc: job $SLURM_JOB_ID (attempt ${SLURM_RESTART_COUNT:-0}, nodes $SLURM_JOB_NODELIST): training ended with $code"
if [ "$code" -eq "${SDC_EXIT_CODE:-86}" ]; then
  sdc report "$RUN_DIR"
  bad=$(sdc exclude-list "$RUN_DIR")
  if [ -n "$bad" ]; then
    scontrol update NodeName="$bad" State=DRAIN Reason="$(sdc exclude-list "$RUN_DIR" --format reason), job $SLURM_JOB_ID"
  fi
  scontrol show config | grep -Eq "^RequeueExit +=.*\b${SDC_EXIT_CODE:-86}\b" || scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"

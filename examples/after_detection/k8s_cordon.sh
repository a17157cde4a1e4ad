#!/usr/bin/env bash
# Kubernetes: the training container's command. It runs the launch command inside `sdc run`
# (torchrun alone exits 1 for any failed worker; `sdc run` exits 86 when the job ended on an SDC
# verdict and keeps every other code). On 86, a pod whose host the verdict named cordons its node
# and labels it the way SageMaker HyperPod's health agent reads, so it is replaced; then the pod
# exits 86 and the Job's podFailurePolicy recreates it (not counted against backoffLimit) on
# another node:
#   podFailurePolicy: {rules: [{action: Ignore, onExitCodes: {containerName: trainer, operator: In, values: [86]}}]}
# Needs NODE_NAME from the downward API (env valueFrom fieldRef spec.nodeName; the checks record
# it as each rank's node, see `sdc node-name`), a service account
# allowed to patch nodes, kubectl in the image, and RUN_DIR on shared storage.
# Usage: examples/after_detection/k8s_cordon.sh torchrun --nnodes=4 --nproc-per-node=8 ... train.py
set -uo pipefail
RUN_DIR=${RUN_DIR:?run directory with sdc/incidents, on shared storage}
sdc run -- "$@"
code=$?
if [ "$code" -eq "${SDC_EXIT_CODE:-86}" ]; then
  sdc report "$RUN_DIR"
  if sdc exclude-list "$RUN_DIR" --format lines | grep -qx "${NODE_NAME:?}"; then  # incidents name NODE_NAME too
    kubectl cordon "$NODE_NAME"
    kubectl label --overwrite node "$NODE_NAME" sagemaker.amazonaws.com/node-health-status=UnschedulablePendingReplacement
  fi
fi
exit "$code"

#!/usr/bin/env bash
# Kubernetes: after a job's pod exits with the SDC code, cordon the named nodes and label them the
# way SageMaker HyperPod's health agent reads, so they are replaced; then let the job controller
# (backoffLimit / podFailurePolicy) restart the job elsewhere.
#   podFailurePolicy: {rules: [{action: Ignore, onExitCodes: {operator: In, values: [86]}}]}
# Usage: examples/after_detection/k8s_cordon.sh RUN_DIR   (RUN_DIR on shared storage)
set -euo pipefail
RUN_DIR=${1:?run directory with sdc/incidents}
for host in $(sdc exclude-list "$RUN_DIR" --format lines); do
  node=$(kubectl get nodes -o name | grep -m1 "$host" || echo "node/$host")
  kubectl cordon "$node"
  kubectl label --overwrite "$node" sagemaker.amazonaws.com/node-health-status=UnschedulablePendingReplacement
done
sdc report "$RUN_DIR"

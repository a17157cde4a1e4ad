#!/usr/bin/env bash
# Install Slurm and munge (Debian/Ubuntu packages, ~10 s) for tests/test_slurm.py, which start a
# private cluster with scripts/slurm_cluster.sh. Only where they are missing and this runs as root
# with apt-get; otherwise one line says so and nothing changes (those tests then skip). Installing
# starts no daemon. Idempotent: nothing to do once installed. SDC_NO_SLURM=1 skips it.
set -uo pipefail
[ "${SDC_NO_SLURM:-0}" = 1 ] && exit 0
export PATH="$PATH:/usr/sbin:/sbin"
for tool in slurmctld slurmd sbatch scontrol munged mungekey; do
  command -v "$tool" >/dev/null || missing=1
done
[ -z "${missing:-}" ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "slurm_setup: Slurm is not installed (needs root and apt-get to install): tests/test_slurm.py will skip" >&2
  exit 0
fi
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 &&
   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     slurmctld slurmd slurm-client munge >>"$log" 2>&1; then
  echo "slurm_setup: installed slurmctld slurmd slurm-client munge" >&2
else
  echo "slurm_setup: installing Slurm failed ($(tail -n1 "$log")): tests/test_slurm.py will skip" >&2
fi
rm -f "$log"
exit 0

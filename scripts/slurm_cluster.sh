#!/usr/bin/env bash
# A private Slurm cluster on this host: one controller and four nodes n1..n4 (one CPU each), for
# the tests of the after-detection routes. Everything (config, munge key and socket, state, spool,
# logs, pid files) lives in DIR; nothing system-wide is started or changed.
#   bash scripts/slurm_cluster.sh start DIR    # prints `export SLURM_CONF=DIR/slurm.conf`
#   bash scripts/slurm_cluster.sh stop DIR     # cancels the jobs, stops every daemon by its PID
# Exit 3 (and one line on stderr) when Slurm or munge is not installed or does not come up.
# A requeued job waits cred_expire seconds before it starts again: 5 s here (120 by default).
# RequeueExit=86 (Slurm requeues a job that exits 86); SDC_SLURM_REQUEUE_EXIT= (empty) leaves it out.
set -uo pipefail
cmd=${1:?usage: slurm_cluster.sh start|stop DIR}
dir=${2:?usage: slurm_cluster.sh start|stop DIR}
nodes=(n1 n2 n3 n4)
export SLURM_CONF="$dir/slurm.conf"
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons, where root's PATH lacks them

die() { echo "slurm_cluster: $*" >&2; exit 3; }

stop_pids() {  # stop_pids PID...: SIGTERM to all at once (a daemon takes ~2 s), SIGKILL to any left after 5 s
  local pid i left
  [ "$#" -gt 0 ] || return 0
  kill "$@" 2>/dev/null || true
  for i in $(seq 50); do
    left=()
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left+=("$pid"); done
    [ "${#left[@]}" -eq 0 ] && return 0
    sleep 0.1
  done
  kill -9 "${left[@]}" 2>/dev/null || true
}

pids_in() { local f; for f in "$@"; do [ -f "$f" ] && cat "$f"; done; return 0; }  # pids_in FILE...

ours() {  # the PIDs of processes started by this cluster (they carry its SLURM_CONF); one grep, not two per process
  grep -lzxF "SLURM_CONF=$SLURM_CONF" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/\([0-9]*\)/environ$#\1#'
  return 0
}

stop() {
  [ -f "$SLURM_CONF" ] || return 0
  if [ -f "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  # shellcheck disable=SC2046  # one PID a word
  stop_pids $(pids_in "$dir"/run/slurmd.*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid")  # one wait, not one each
  stop_pids $(ours | grep -vx "$$")  # job steps left behind, if any
  return 0
}

start() {
  local tool
  for tool in slurmctld slurmd sbatch scontrol munged mungekey; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install slurmctld slurmd slurm-client munge)"
  done
  [ "$(id -u)" -eq 0 ] || die "the daemons run as root here (SlurmUser=root); run as root"
  mkdir -p "$dir"/{munge,state,log,run} "${nodes[@]/#/$dir/spool/}" && chmod 755 "$dir" "$dir/munge" || die "cannot create $dir"
  local sock="$dir/munge/munge.socket" ports p i
  read -r -a ports < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
  ) || die "no free ports"
  mungekey -c -f -k "$dir/munge/munge.key" 2>"$dir/log/mungekey.log" || die "mungekey failed: $(cat "$dir/log/mungekey.log")"
  munged --socket="$sock" --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.pid" \
    --seed-file="$dir/munge/seed" --log-file="$dir/log/munged.log" 2>>"$dir/log/munged.log" \
    || die "munged did not start: $(tail -n1 "$dir/log/munged.log")"
  cat >"$SLURM_CONF" <<EOF
ClusterName=sdc
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
MpiDefault=none
ReturnToService=2
KillWait=5
SchedulerParameters=sched_interval=2,bf_interval=1
EOF
  local requeue=${SDC_SLURM_REQUEUE_EXIT-86}
  [ -z "$requeue" ] || echo "RequeueExit=$requeue" >>"$SLURM_CONF"
  for i in "${!nodes[@]}"; do
    p=${ports[$((i + 1))]}
    echo "NodeName=${nodes[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$p CPUs=1 RealMemory=500 State=UNKNOWN" >>"$SLURM_CONF"
  done
  echo "PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
  slurmctld -f "$SLURM_CONF" -c -i 2>>"$dir/log/slurmctld.log" || die "slurmctld did not start (see $dir/log)"
  for i in "${nodes[@]}"; do
    slurmd -f "$SLURM_CONF" -N "$i" 2>>"$dir/log/slurmd.$i.log" || die "slurmd $i did not start (see $dir/log)"
  done
  for _ in $(seq 150); do
    [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" -eq "${#nodes[@]}" ] && { echo "export SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.1
  done
  die "the nodes did not come up idle in 15 s: $(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')"
}

case "$cmd" in
  start) (start) || { rc=$?; stop; exit "$rc"; } ;;
  stop) stop ;;
  *) echo "usage: slurm_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac

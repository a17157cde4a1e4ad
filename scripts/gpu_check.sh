#!/usr/bin/env bash
# shellcheck disable=SC2329  # the stages' functions are called as "stage_$s"
# The GPU checks in stages that each fit a short loan of one GPU (each stage under 4 minutes).
#
#   bash scripts/gpu_check.sh STAGE OUT_DIR            STAGE: trust, bench, memory, matmul, kernels or all
#   bash scripts/gpu_check.sh --dry-run STAGE OUT_DIR  (or SDC_GPU_DRY_RUN=1): on the CPU, tiny sizes
#   bash scripts/gpu_check.sh OUT_DIR                  a lone path: all stages (the older form)
#   bash scripts/gpu_check.sh                          all stages into gpu-results/
#   (a relative OUT_DIR is taken from the repository root; a stage name alone writes to gpu-results/)
#
# Stages, most important first (run trust first; one call per stage fits a short loan):
#   trust   the GPU pytest suite (-m "gpu or not slow": tests/test_gpu.py, the digest kernel, copy-path
#           and backend-parsing tests) -> trust.log, gpu_suite.xml; then the ring replay's modes on
#           nondeterministic kernels (3 ranks on one GPU, tests/gpu_replay_check.py) -> gpu_replay.json,
#           judged: clean runs raise nothing, each injected fault is named on its rank and step; then a
#           kernel noisy on some calls only (tests/nondeterminism_scenarios.py --device cuda) ->
#           nondeterminism/, judged the same way
#   bench   the checks' cost on the 60M/270M/1.4B GPT-style step, with the matrix-product check as a
#           third configuration and the every-step screen's host read before the update as a fourth
#           (python -m benchmarks.gpu_step --matmul --host-wait --screen-next) -> bench.log, gpu_step.json; then
#           where the 60M step's time goes, with and without the matrix-product check
#           (python -m benchmarks.gpu_profile --matmul) -> profile.txt
#   memory  peak device memory of clean and audited steps, DDP's default layout and bucket views
#           (2 ranks on the GPU, python -m benchmarks.memory) -> memory.log, memory.json,
#           memory-bucket-view.json
#   matmul  the matrix-product check's clean runs (fp32, TF32 allowed, bf16 autocast) and the
#           false-alarm stress on this GPU's kernels, then its cost at the 270M model's width
#           (python -m benchmarks.matmul) -> matmul.log, matmul_clean.json, matmul_stress.json,
#           matmul_cost.json
#   kernels the Triton digest's launch shapes against a flat sum, each shape's digests checked against the
#           shipped one (python -m benchmarks.digest_blocks: judged, any differing digest fails the stage)
#           -> digest_blocks.json; then the performance page's kernel table on the device (fingerprint,
#           non-finite read, SHA-1 of host bytes, ... against a sum; python -m benchmarks --sections
#           kernels) -> performance-gpu-kernels.json
#   all     the five in that order
#
# Every stage tees its output into OUT_DIR/<stage>.log as it runs (appended, a header per run),
# rewrites its JSON, and appends one line to OUT_DIR/summary.txt: "<stage> PASS|FAIL <seconds>s: ...".
# The exit status is 0 when every stage run passed, 1 when one failed, 2 for a usage error.
# A stage's limit bounds its steps together (each killed 10 s after its own timeout at the latest).
# Timeouts (seconds, each stage's total and its steps' own): SDC_GPU_TRUST_TIMEOUT (235),
# SDC_GPU_SUITE_TIMEOUT (170), SDC_GPU_REPLAY_TIMEOUT (60),
# SDC_GPU_INTERMITTENT_TIMEOUT (50), SDC_GPU_BENCH_TIMEOUT (200),
# SDC_GPU_MEMORY_TIMEOUT (180), SDC_GPU_MATMUL_TIMEOUT (225), SDC_GPU_KERNELS_TIMEOUT (200). SDC_GPU_SKIP=memory,matmul leaves
# stages out (reported as skipped); SDC_GPU_BENCH_ARGS replaces the benchmark's arguments
# (default "--matmul --host-wait --screen-next --rounds 6"). Uses $PYTHON, default python3 (the machine's torch with CUDA: no venv, no
# install). The dry run hides CUDA, collects the suite instead of running it, runs every python entry
# point on the CPU with tiny sizes and says in the summary what it skipped.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

STAGES=(trust bench memory matmul kernels)
ACCEPTED="trust, bench, memory, matmul, kernels, all"
die() { echo "gpu_check.sh: $1 (stages: $ACCEPTED; usage: bash scripts/gpu_check.sh [--dry-run] STAGE OUT_DIR)" >&2; exit 2; }

dry="${SDC_GPU_DRY_RUN:-0}"
[ "$dry" = 0 ] || [ "$dry" = 1 ] || die "SDC_GPU_DRY_RUN must be 0 or 1, got '$dry'"
args=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h | --help) sed -n '3,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$arg'" ;;
    *) args+=("$arg") ;;
  esac
done
is_stage() { case "$1" in trust | bench | memory | matmul | kernels | all) return 0 ;; *) return 1 ;; esac; }
case "${#args[@]}" in
  0) stage=all out=gpu-results ;;
  1) if is_stage "${args[0]}"; then stage="${args[0]}" out=gpu-results; else stage=all out="${args[0]}"; fi ;;
  2) stage="${args[0]}" out="${args[1]}"; is_stage "$stage" || die "unknown stage '$stage'" ;;
  *) die "too many arguments" ;;
esac
[ "$stage" = all ] && run_stages=("${STAGES[@]}") || run_stages=("$stage")
mkdir -p "$out" || die "cannot make the output folder '$out'"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ "$dry" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # the CPU paths, one thread each
  tag=" [dry run]"
else
  tag=""
fi

tree_id() {  # the commit, and how many files differ from it (a copied tree can carry an older .git)
  local head changed
  head=$(git rev-parse --short HEAD 2>/dev/null) || { echo '?'; return; }
  changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
  [ "$changed" = 0 ] && echo "$head" || echo "$head + $changed changed files"
}

# -- one stage: a deadline, a log, notes for its summary line --------------------------------------
begin() {  # begin STAGE SECONDS
  name=$1 deadline=$((SECONDS + $2)) started=$SECONDS failed=0 notes=() log="$out/$1.log"
  echo "== $name$tag $(date -u +%FT%TZ) (limit $2 s) ==" | tee -a "$log"
}
note() { notes+=("$1"); }
step() {  # step LABEL SECONDS CMD...: CMD under the smaller of SECONDS and the stage's time left, teed
  local label=$1 own=$2 left limit rc
  shift 2
  left=$((deadline - SECONDS))
  limit=$((own < left ? own : left))
  if [ "$limit" -le 0 ]; then
    note "$label not run: stage TIMEOUT (its time was spent)"
    failed=1
    return 1
  fi
  echo "-- $label (timeout ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    note "$label TIMEOUT after ${limit}s"
  else
    note "$label exit $rc"
  fi
  [ "$rc" = 0 ] || failed=1
  return "$rc"
}
finish() {
  local status=PASS joined=""
  [ "$failed" = 0 ] || status=FAIL
  [ "${#notes[@]}" = 0 ] || joined=$(printf '; %s' "${notes[@]}")
  echo "$name $status $((SECONDS - started))s$tag: ${joined#; }" | tee -a "$log" "$out/summary.txt"
  [ "$failed" = 0 ] || any_failed=1
}
summarize() {  # summarize KIND FILE: a short digest of a JSON result into the notes (never fails the stage)
  local line
  [ -s "$2" ] || return 0
  line=$("$PY" - "$1" "$2" <<'EOF' 2>/dev/null
import json, sys
kind, data = sys.argv[1], json.load(open(sys.argv[2]))
if kind == "bench":
    parts = []
    for r in data["rows"]:
        s = r["step_ms"]
        mm = f", matmul {100 * s['matmul_overhead']:+.1f}%" if "matmul_overhead" in s else ""
        mm += f", host wait {100 * s['host_wait_overhead']:+.1f}%" if "host_wait_overhead" in s else ""
        mm += f", screen next step {100 * s['screen_next_overhead']:+.1f}%" if "screen_next_overhead" in s else ""
        parts.append(f"{r['model']} {100 * s['overhead']:+.1f}%{mm} (fp/flat sum {r['fingerprint_vs_sum']['flat']:.2f}x)")
    print("step cost: " + ", ".join(parts))
elif kind == "memory":
    ex = data.get("excess_vs_weights", {})
    print(("bucket views" if data["gradient_as_bucket_view"] else "default layout") + ": "
          + ", ".join(f"{c} {100 * v:+.1f}%" for c, v in ex.items() if c != "none") + " of the weights")
elif kind == "matmul_cost":
    print("cost: " + ", ".join(f"w{r['width']} {r['precision']} {100 * r['overhead']['checksum']:+.1f}%"
                               for r in data["results"]))
EOF
  ) && [ -n "$line" ] && note "$line"
  return 0
}

judge() {  # judge FILE <<'EOF' (python reading FILE, printing one line, exit 1 when wrong): logged, noted
  local verdict
  verdict=$("$PY" - "$1" 2>&1) || failed=1
  echo "$verdict" | tee -a "$log"
  note "${verdict##*$'\n'}"
}

# -- the stages ------------------------------------------------------------------------------------
stage_trust() {
  begin trust "${SDC_GPU_TRUST_TIMEOUT:-235}"
  local files=(tests/test_gpu.py tests/test_fingerprint_batched.py tests/test_device_paths_unit.py
    tests/test_replay_copies.py)
  rm -f "$out/gpu_replay.json" "$out/gpu_suite.xml"
  if [ "$dry" = 1 ]; then
    step suite-collect "${SDC_GPU_SUITE_TIMEOUT:-170}" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
      --collect-only "${files[@]}"
    note "skipped: the suite's run (CUDA; collected only)"
  else
    step suite "${SDC_GPU_SUITE_TIMEOUT:-170}" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not slow" -rs \
      --junitxml "$out/gpu_suite.xml" "${files[@]}"
  fi
  # the ring replay's modes on nondeterministic GPU kernels (3 gloo ranks on one GPU; CPU: tiny sizes)
  if step replay "${SDC_GPU_REPLAY_TIMEOUT:-60}" env OUT="$out" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 3 tests/gpu_replay_check.py; then
    judge "$out/gpu_replay.json" <<'EOF'
import json, sys
r, bad = json.load(open(sys.argv[1])), []
for s in ("det_clean", "off_clean"):  # a clean run raises nothing
    if r[s]["error"] is not None:
        bad.append(f"{s} raised {r[s]['error']['type']}")
e = r["off_exact"]["error"]  # bit equality without determinism may be refused, never blamed
if e is not None and e["type"] != "ReplayUnavailableError":
    bad.append(f"off_exact raised {e['type']}")
for s, rank, at in (("det_fault", 1, 3), ("off_fault", 2, 5)):  # each fault named on its rank and step
    e = r[s]["error"] or {}
    if (e.get("type"), e.get("rank"), e.get("step")) != ("ReplayMismatchError", rank, at):
        bad.append(f"{s} not named as rank {rank} step {at}: {e.get('type')} rank {e.get('rank')} step {e.get('step')}")
if r["stale_read"]["new_wrong_reads"]:
    bad.append(f"stale reads {r['stale_read']['new_wrong_reads']} of {r['stale_read']['of']}")
print("replay verdicts " + ("as expected" if not bad else "WRONG: " + ", ".join(bad)))
sys.exit(1 if bad else 0)
EOF
  fi
  # a kernel noisy on some calls only (a lucky exact audit must not make a later noisy one a verdict)
  local nd="$out/nondeterminism" runs=6 device=cuda
  [ "$dry" = 0 ] || runs=2 device=cpu
  rm -rf "$nd"
  if step intermittent "${SDC_GPU_INTERMITTENT_TIMEOUT:-50}" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 3 tests/nondeterminism_scenarios.py --out "$nd" --device "$device" --runs "$runs" \
    --only some:every,every:every,some:every:activation,some:every:backward; then
    judge "$nd" <<'EOF'
import json, sys
from pathlib import Path
out, bad = Path(sys.argv[1]), []
def runs(s):
    return json.loads((out / f"{s}.rank0.json").read_text())["runs"]
for s in ("some:every", "every:every"):  # clean runs raise nothing
    bad += [f"{s} run {i}: {r['error']['message'][:120]}" for i, r in enumerate(runs(s)) if r["error"]]
for s, rank in (("some:every:activation", 2), ("some:every:backward", 0)):  # named on its rank at step 2
    e = runs(s)[0]["error"] or {}
    if (e.get("type"), e.get("rank"), e.get("step")) != ("ReplayMismatchError", rank, 2):
        bad.append(f"{s} not named as rank {rank} step 2: {e.get('type')} rank {e.get('rank')} step {e.get('step')}")
print("intermittent kernel verdicts " + ("as expected" if not bad else "WRONG: " + "; ".join(bad)))
sys.exit(1 if bad else 0)
EOF
  fi
  [ "$dry" = 0 ] || note "the replay on the CPU (tiny sizes)"
  finish
}

stage_bench() {
  begin bench "${SDC_GPU_BENCH_TIMEOUT:-200}"
  rm -f "$out/gpu_step.json"
  local extra
  if [ "$dry" = 1 ]; then
    read -r -a extra <<<"--matmul --host-wait --screen-next --quick --device cpu --sizes tiny --steps 1 --rounds 1"
    note "skipped: the 60M/270M/1.4B sizes (CUDA; tiny on the CPU)"
  else
    read -r -a extra <<<"${SDC_GPU_BENCH_ARGS:---matmul --host-wait --screen-next --rounds 6}"
  fi
  step gpu_step 135 "$PY" -m benchmarks.gpu_step "${extra[@]}" --out "$out/gpu_step.json"
  summarize bench "$out/gpu_step.json"
  # where the 60M step's cost goes (host time, launches, operators, sdc_core's Python): profile.txt
  local profile=(--size 60M --matmul)
  [ "$dry" = 0 ] || profile=(--size tiny --device cpu --steps 2 --matmul)
  rm -f "$out/profile.txt"
  step profile 75 "$PY" -m benchmarks.gpu_profile "${profile[@]}" --out "$out"
  finish
}

stage_memory() {
  begin memory "${SDC_GPU_MEMORY_TIMEOUT:-180}"
  local sizes=(--device cuda --spec "1024,12,16,32000" --batch 8 --seq 512) view file
  if [ "$dry" = 1 ]; then
    sizes=(--device cpu --spec "64,2,4,256" --batch 2 --seq 16 --steps 1 --skip 1)
    note "skipped: CUDA allocator peaks (CPU storage count, tiny model)"
  fi
  for view in "" --bucket-view; do  # DDP's default gradient layout, then gradient_as_bucket_view=True
    file="$out/memory${view:+-bucket-view}.json"
    rm -f "$file"
    step "memory${view:+ $view}" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m benchmarks.memory "${sizes[@]}" --configs none,defaults,audited ${view:+"$view"} --out "$file"
    summarize memory "$file"
  done
  finish
}

stage_matmul() {
  begin matmul "${SDC_GPU_MATMUL_TIMEOUT:-225}"
  local clean=(--clean-steps 300) stress=(--stress) cost=(--widths 1024 --precisions "fp32,bf16" --rounds 4 --batch 8
    --seq 512 --breakdown-shapes "4096,1024,3072;4096,1024,1024;4096,1024,4096;4096,4096,1024;4096,1024,2000")
  rm -f "$out"/matmul_{clean,stress,cost}.json
  if [ "$dry" = 1 ]; then
    clean=(--clean-steps 2) stress=(--stress --stress-shapes "4,40,8;3,5,7")
    cost=(--widths 32 --precisions "fp32,bf16" --rounds 1 --batch 2 --seq 8 --breakdown-shapes "16,64,64")
    note "skipped: CUDA kernels (TF32, the stress's large shapes; tiny on the CPU)"
  fi
  # clean runs with the check on every step: no alarm with TF32 allowed or under bf16 autocast
  step clean 60 "$PY" -m benchmarks.matmul "${clean[@]}" --precisions fp32,tf32,bf16 --out "$out/matmul_clean.json"
  # the false-alarm stress on this device's kernels (fp32, TF32, bf16, fp16) and a wrong element caught per phase
  step stress 120 "$PY" -m benchmarks.matmul "${stress[@]}" --out "$out/matmul_stress.json"
  # its cost in a step at the 270M model's width (benchmarks.matmul's transformer; bench has the 270M step)
  step cost 90 "$PY" -m benchmarks.matmul "${cost[@]}" --out "$out/matmul_cost.json"
  summarize matmul_cost "$out/matmul_cost.json"
  finish
}

stage_kernels() {
  begin kernels "${SDC_GPU_KERNELS_TIMEOUT:-200}"
  local blocks=(--budget 100) table=(--device cuda)
  rm -f "$out/digest_blocks.json" "$out/performance-gpu-kernels.json"
  if [ "$dry" = 1 ]; then
    blocks=(--dry-run --reps 2) table=(--device cpu --quick)
    note "skipped: the Triton kernel (the torch digest in its place) and the large sizes (CUDA)"
  fi
  # every launch shape's digests equal the shipped one's, and how fast each reads against a flat sum
  if step digest_blocks 130 "$PY" -m benchmarks.digest_blocks "${blocks[@]}" --out "$out/digest_blocks.json"; then
    judge "$out/digest_blocks.json" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
shipped, bad, ratios = "{}/{}".format(*data["shipped"]), [], []
for name, row in data["sets"].items():
    done = {k: v for k, v in row["configs"].items() if isinstance(v, dict)}
    bad += [f"{name} {k}" for k, v in done.items() if not v["same_digests"]]
    if shipped in done:
        ratios.append(done[shipped]["vs_flat_sum"])
speed = f"shipped {shipped}: {min(ratios):.2f}-{max(ratios):.2f}x of a flat sum" if ratios else "shipped shape not timed"
print(("digests WRONG: " + ", ".join(bad) + "; " if bad else "launch shapes give the same digests; ") + speed)
sys.exit(1 if bad else 0)
EOF
  fi
  # the performance page's kernel table on this device (its section 1 is the CPU's)
  step kernel_table 60 "$PY" -m benchmarks --sections kernels "${table[@]}" --out "$out/performance-gpu-kernels.json"
  finish
}

# -- the call --------------------------------------------------------------------------------------
any_failed=0
{
  echo "gpu_check.sh $stage $out$tag, $(date -u +%FT%TZ), tree $(tree_id)"
  "$PY" -c 'import torch; c = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if c else "(no CUDA device)")'
  [ "$dry" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee -a "$out/machine.txt"
skip=",${SDC_GPU_SKIP:-},"
for s in "${run_stages[@]}"; do
  if [[ "$skip" == *",$s,"* ]]; then
    echo "$s SKIPPED 0s$tag: in SDC_GPU_SKIP" | tee -a "$out/summary.txt"
    continue
  fi
  "stage_$s"
done
exit "$any_failed"

#!/usr/bin/env bash
# The GPU check (`bash benchmarks/gpu/run.sh`, or `make gpu-check`): one
# command on a GPU machine, GPU work only, each step under its own time limit
# and the whole under GPU_CHECK_BUDGET (530 s):
#   probe    python, torch and the device, under GPU_CHECK_PROBE_LIMIT (90 s);
#            a probe that hangs or fails ends the check (INCOMPLETE or FAIL),
#            with its summary written;
#   install  the prepared CUDA wheel (.gpu-prep/, from `make gpu-prep` where .git
#            is) installed beside the machine's torch (pip --no-deps, no network),
#            proven to be the wheel's extension byte for byte
#            (build_support/check_wheel.py) and built from the tree's sources
#            (build_support/gpu_prep.py check); the commit comes from
#            .gpu-prep/prep.json. Without a prepared wheel: the extension built in
#            place with a compiler that links libstdc++ dynamically
#            (build_support/libstdcxx.py), and the commit recorded as unknown, with
#            the reason (git's HEAD where the tree has its .git);
#   tests    the CUDA tests, selected by their marker (pytest -m "cuda and not
#            cuda_compile"), results written as they arrive (budget_plugin.py), on
#            GPU_CHECK_TEST_WORKERS pytest-xdist workers;
#   bench    benchmarks/bench_ring_gpu.py: every cell in a worker process with its
#            own limit (30 s), its JSON rewritten after every cell;
#   memcheck compute-sanitizer over cplib's CUDA kernels (merge, halo) against
#            their C twins, the ring's per-step block backward, and tp_convolution
#            through the op on CUDA; a run that selects nothing fails;
#   demo     examples/demo.py --device cuda (torchrun, NCCL, one rank);
#   compile  the CUDA tests that compile Triton kernels for several rank threads
#            (pytest -m cuda_compile), alone, 2 workers, with inductor's parallel
#            compile (TORCHINDUCTOR_COMPILE_THREADS=8; 1 elsewhere).
# Every stage runs even after another failed. A stage is PASS only when all of
# it ran and passed: its commands exited 0 within their limits and what they
# wrote says so. A command that exits non-zero, a failed test, a cplib benchmark
# cell with an error, NaN or time-out, a memcheck error make it FAIL; a stage
# out of time, a test skipped, left out or unfinished, a baseline cell without
# a figure or a skipped cell, a memcheck run without the sanitizer's "ERROR
# SUMMARY" line make it INCOMPLETE; the summary names each. What a command
# leaves running is ended after it, also what left its process group or
# session (reap.py), so nothing holds the GPU through a later stage. The
# summary is written before the probe and after every stage: a run cut short
# reads INCOMPLETE (or FAIL). Without a GPU the tests stage runs (its tests
# skip) and the others are skipped: the verdict is INCOMPLETE, exit status 2.
#
# Output: $OUT when set, else benchmarks/out/gpu-check/; at most 8 files, flat:
# summary.txt, tests_summary.txt, compile_summary.txt, bench_ring_gpu.log,
# bench_ring_gpu.json and
# gpu-check-files.tar.gz (gpu.json, the PNGs, every log). Exit status: 0 PASS,
# 1 FAIL, 2 INCOMPLETE.
#
#   bash benchmarks/gpu/run.sh                      # everything, within the budget
#   bash benchmarks/gpu/run.sh --dry-run            # print what would run, run nothing
#   bash benchmarks/gpu/run.sh --stages install,tests
#
# Environment: PYTHON (python3), GPU_CHECK_PREP (the prepared folder, .gpu-prep),
# GPU_CHECK_BUDGET (530), GPU_CHECK_PROBE_LIMIT (90), GPU_CHECK_CAP_<STAGE> (a
# stage's limit: INSTALL 120, TESTS 160, BENCH 150, DEMO 40, COMPILE 150 s; memcheck's three
# runs have 20, 25 and 15 s), GPU_CHECK_TEST_WORKERS (8; 0 = one process), MAX_JOBS (16), CC / CXX (for the in-place build),
# GPU_CHECK_BENCH_ARGS (more bench_ring_gpu.py arguments), GPU_CHECK_ASSUME_GPU=1
# (run the GPU stages without a GPU: tests this script's failure paths),
# GPU_CHECK_SKIP_BUILD=1 (no prepared wheel: use the cplib python already finds
# instead of building), GPU_CHECK_FAKE_<STEP> for STEP in PROBE, INSTALL, TESTS,
# BENCH, MEMCHECK, DEMO, COMPILE (a shell command run in place of each of that step's
# commands, with their `env` settings, under the same limits and verdict:
# tests/gpu/test_gpu_check.py fakes failures with them).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
PREP=${GPU_CHECK_PREP:-$ROOT/.gpu-prep}
OUT_DIR=${OUT:-$ROOT/benchmarks/out/gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-530}
PROBE_LIMIT=${GPU_CHECK_PROBE_LIMIT:-90}
WORKERS=${GPU_CHECK_TEST_WORKERS:-8}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
declare -A CAP=([install]=120 [tests]=160 [bench]=170 [demo]=40 [compile]=150)  # memcheck: its runs' own
for s in "${!CAP[@]}"; do v=GPU_CHECK_CAP_${s^^}; CAP[$s]=${!v:-${CAP[$s]}}; done
ALL_STAGES="install tests bench memcheck demo compile"
FLAT="summary.txt tests_summary.txt compile_summary.txt bench_ring_gpu.log bench_ring_gpu.json gpu-check-files.tar.gz"
STAGES=$ALL_STAGES
DRY=0

while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --stages) STAGES=${2//,/ }; shift ;;
    --stages=*) STAGES=${1#--stages=}; STAGES=${STAGES//,/ } ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 64 ;;
  esac
  shift
done
for s in $STAGES; do
  [[ " $ALL_STAGES " == *" $s "* ]] || { echo "run.sh: unknown stage '$s' (stages: $ALL_STAGES)" >&2; exit 64; }
done

mkdir -p "$OUT_DIR"
for f in $FLAT; do rm -f "$OUT_DIR/$f"; done
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
START=$(date +%s)
DEADLINE=$((START + BUDGET))
declare -a SUMMARY=() DETAILS=()
RESULT=PASS RC=0 SECS=0 LIMIT=0 OUTCOME=ok
DEVICE="device not probed yet"
WHEEL=$(ls "$PREP"/cplib-*.whl 2>/dev/null | head -n 1)
COMMIT=$("$PY" build_support/gpu_prep.py commit ${WHEEL:+"$PREP"} 2>&1 | tail -n 1)
export CPLIB_COMMIT=$COMMIT

note() { printf '[gpu-check %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }

# record STEP VERDICT SECONDS DETAILS: VERDICT is PASS, FAIL, INCOMPLETE or
# SKIP; anything else (a report that crashed) counts as FAIL.
record() {
  local verdict=$2
  case $verdict in
    PASS) ;;
    INCOMPLETE|SKIP) [[ $RESULT == FAIL ]] || RESULT=INCOMPLETE ;;
    *) verdict=FAIL RESULT=FAIL ;;
  esac
  SUMMARY+=("$(printf '%-9s %-10s %5s  %s' "$1" "$verdict" "$3" "$4")")
  note "$1: $verdict ($3 s) $4"
}

detail() { DETAILS+=("  $1: $2"); }  # detail STEP TEXT: what did not pass, for the summary

# run_capped STEP LIMIT LOG CMD...: CMD under LIMIT seconds, its output in LOG;
# sets RC, SECS, LIMIT and OUTCOME (ok, failed or timeout). The command and
# everything it starts carry a token of their own (GPU_CHECK_STAGE); what
# still carries it once the command is over (left in the background, or out
# of the process group that `timeout` kills: setsid) is ended (reap.py).
# GPU_CHECK_FAKE_<STEP> runs in place of CMD (see the head of this file).
run_capped() {
  local step=$1 token t0 fake=GPU_CHECK_FAKE_${1^^} log=$3
  LIMIT=$2; shift 3
  if [[ -n ${!fake:-} ]]; then  # the fake keeps the command's `env` settings (its output folder)
    local keep=()
    if [[ $1 == env ]]; then keep=(env); shift; while [[ ${1:-} == *=* ]]; do keep+=("$1"); shift; done; fi
    set -- ${keep[@]+"${keep[@]}"} bash -c "${!fake}" "fake-$step" "$@"
  fi
  token="$$-$step-$RANDOM$RANDOM"
  t0=$(date +%s)
  GPU_CHECK_STAGE=$token timeout -k 10 "$LIMIT" "$@" >"$log" 2>&1
  RC=$?
  SECS=$(($(date +%s) - t0))
  "$PY" "$ROOT/benchmarks/gpu/reap.py" "$token" >>"$log" 2>&1
  if ((RC == 0)); then OUTCOME=ok
  elif ((RC == 124 || RC == 137)) && ((SECS >= LIMIT)); then OUTCOME=timeout
  else OUTCOME=failed; fi
}

# run_limited STAGE CAP LOG CMD...: run_capped under the stage's limit (its
# cap, or what is left of the budget; OUTCOME=notime where under 5 s are left).
run_limited() {
  local stage=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE - $(date +%s)))
  LIMIT=$((cap < left ? cap : left))
  if ((DRY)); then printf '  %-9s (limit %ss): %s\n' "$stage" "$cap" "$*"; RC=0 SECS=0 OUTCOME=ok; return; fi
  if ((left < 5)); then
    echo "no time left of the ${BUDGET}s budget" >"$log"; RC=0 SECS=0 OUTCOME=notime; return
  fi
  run_capped "$stage" "$LIMIT" "$log" "$@"
}

# settle VERDICT: a step's VERDICT (what its outputs say) with its command's
# OUTCOME: a command that exited non-zero makes it FAIL; one that ran out of
# time, or had none, makes it INCOMPLETE unless it is FAIL already.
settle() {
  case $OUTCOME in
    failed) echo FAIL ;;
    timeout|notime) if [[ $1 == FAIL ]]; then echo FAIL; else echo INCOMPLETE; fi ;;
    *) echo "$1" ;;
  esac
}

why() {  # why LOG: a command's reason for not passing, from its OUTCOME and LOG
  case $OUTCOME in
    timeout) echo "timed out after ${LIMIT}s" ;;
    notime) echo "not run: no time left of the ${BUDGET}s budget" ;;
    *) local line
       line=$(grep -E '^[A-Za-z_.]*(Error|Exception)\b|error: ' "$1" | grep -v '^torch.distributed.elastic' | tail -n 1)
       [[ -n $line ]] || line=$(grep -Ev '^\s*$|^=+' "$1" | tail -n 1)
       echo "exit $RC: $(cut -c1-150 <<<"$line")" ;;
  esac
}

source "$ROOT/benchmarks/gpu/stages.sh"

# The summary and the archive, rewritten before the probe and after every
# stage: a run cut short leaves what it found, and a verdict that is not PASS
# ($1: the steps not run yet).
write_outputs() {
  local verdict=$RESULT
  [[ -n $1 && $RESULT != FAIL ]] && verdict=INCOMPLETE
  {
    echo "=== GPU check: $verdict${1:+ (cut short before: $1)}; $DEVICE; $(date -u +"%Y-%m-%d %H:%M UTC")"
    echo "commit: $COMMIT"
    printf '%-9s %-10s %5s  %s\n' stage result secs details
    printf '%s\n' "${SUMMARY[@]}"
    printf '%-9s %-10s %5s  %s\n' total "$verdict" "$(($(date +%s) - START))" \
      "budget ${BUDGET}s; stages run: $STAGES"
    if [[ $verdict != PASS ]]; then
      echo; echo "not PASS because:"; printf '%s\n' "${DETAILS[@]}"
      [[ -z $1 ]] || echo "  not run yet: $1"
    fi
  } >"$LOGS/summary.txt"
  bundle
  cp "$LOGS/summary.txt" "$OUT_DIR/summary.txt"
  local count
  count=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
  echo "files in the output folder: $count (at most 8 come back): $(cd "$OUT_DIR" && ls | tr '\n' ' ')" \
    >>"$OUT_DIR/summary.txt"
}

finish() {  # finish: the summary's last words, then the verdict's exit status
  rm -rf "$LOGS"
  if [[ -f $OUT_DIR/bench_ring_gpu.log ]]; then
    echo; awk '/^### goals/{f=1} f' "$OUT_DIR/bench_ring_gpu.log" | head -n 30
  fi
  echo; cat "$OUT_DIR/summary.txt"
  case $RESULT in PASS) exit 0 ;; FAIL) exit 1 ;; *) exit 2 ;; esac
}

# ------------------------------------------------------------------ main

((DRY)) || write_outputs "probe $STAGES"  # a verdict exists from the start
# One python start for the device and the environment (torch takes seconds to
# import), under its own limit: an import or a driver that hangs ends the
# check with its summary written.
cat >"$LOGS/probe.py" <<'PROBE'
import importlib.util, sys
import torch
gpu = torch.cuda.is_available()
print(f"{torch.cuda.get_device_name() if gpu else 'no CUDA GPU'} | torch {torch.__version__}")
print(int(gpu))
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
for m in ("pytest", "xdist", "pytest_timeout", "matplotlib", "ninja"):
    print(f"{m}: {'yes' if importlib.util.find_spec(m) else 'MISSING'}")
PROBE
run_capped probe "$PROBE_LIMIT" "$LOGS/probe.log" "$PY" "$LOGS/probe.py"
if [[ $OUTCOME != ok ]] && ((DRY)); then
  echo "gpu-check dry run: the probe did not finish ($(why "$LOGS/probe.log")); a real run would stop here"
elif [[ $OUTCOME != ok ]]; then
  DEVICE="device unknown (the probe did not finish)"
  record probe "$(settle PASS)" "$SECS" "python, torch and the device: $(why "$LOGS/probe.log")"
  detail probe "the start-up probe ($PY: import torch, torch.cuda) did not finish, so no stage ran ($STAGES)"
  write_outputs ""
  finish
fi
DEVICE=$(sed -n 1p "$LOGS/probe.log")
GPU=$(sed -n 2p "$LOGS/probe.log")
[[ $GPU == 1 ]] || GPU=0
[[ ${GPU_CHECK_ASSUME_GPU:-0} == 1 ]] && GPU=1  # the GPU stages without a GPU: their failure paths
((DRY)) && GPU=1
{
  date -u +"%Y-%m-%d %H:%M UTC"; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  tail -n +3 "$LOGS/probe.log"
  command -v nvcc && nvcc --version | tail -n 1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  echo "commit: $COMMIT"; [[ -n $WHEEL ]] && cat "$PREP/prep.json"
} >"$LOGS/env.txt" 2>&1
if ((DRY)); then
  echo "gpu-check dry run: stages '$STAGES', output $OUT_DIR, budget ${BUDGET}s, PYTHON=$PY, prepared wheel: ${WHEEL:-none}"
  echo "commit: $COMMIT"
else
  note "device: $DEVICE; commit: $COMMIT; output: $OUT_DIR; budget ${BUDGET}s"
  ((GPU)) || note "no CUDA GPU visible: the tests stage's tests skip, bench, memcheck, demo and compile are skipped"
fi

left=" $STAGES "
for s in $STAGES; do
  ((DRY)) || note "$s ..."
  "stage_$s"
  left=${left/ $s / }
  ((DRY)) || write_outputs "$(xargs <<<"$left")"
done
((DRY)) && { rm -rf "$LOGS"; exit 0; }
skipped=""
for s in $ALL_STAGES; do [[ " $STAGES " == *" $s "* ]] || skipped+=" $s"; done
if [[ -n $skipped ]]; then  # --stages: the whole check did not run
  [[ $RESULT == FAIL ]] || RESULT=INCOMPLETE
  DETAILS+=("  not run (--stages):$skipped")
fi
write_outputs ""
finish

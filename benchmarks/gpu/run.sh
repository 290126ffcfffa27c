#!/usr/bin/env bash
# The GPU check: from a copy of the repository on a GPU machine,
#   build    the extension in place with the system compiler (CC=/usr/bin/gcc
#            CXX=/usr/bin/g++ unless CXX links libstdc++ dynamically; a libstdc++
#            linked into _C.so makes every error message segfault), MAX_JOBS=16,
#            against the installed torch;
#   tests    the suite on 12 workers in at most 300 s: the tests that need a GPU
#            first, then as much of the rest as fits (tests_summary.txt: counts,
#            failing tests, what was left out; written even on a timeout);
#   memcheck compute-sanitizer --tool memcheck over the CUDA kernels' checks;
#   demo     examples/demo.py --device cuda (torchrun, NCCL, one rank);
#   bench    benchmarks/bench_ring_gpu.py (the ring's speed table, JSON, PNG), told
#            to stop starting new rows 30 s before its limit;
# each stage under a time limit, every stage run even after a failure. Logs,
# JSON and PNGs go to one folder ($OUT when set, else
# benchmarks/out/gpu-check/): summary.txt, tests.log, tests_summary.txt, bench_ring_gpu.{json,png,log},
# demo_loss.png and every log in gpu-check-logs.tar.gz. A summary is printed
# last; the exit status is 0 only if every stage passed (2: no GPU visible).
#
#   benchmarks/gpu/run.sh                      # everything (about 7 min on an H100)
#   benchmarks/gpu/run.sh --dry-run            # print what would run, run nothing
#   benchmarks/gpu/run.sh --stages build,tests # some stages only
#
# Environment: PYTHON (python3), MAX_JOBS (16), CC / CXX (kept if CXX links libstdc++
# dynamically, else /usr/bin/gcc, /usr/bin/g++: build_support/libstdcxx.py),
# GPU_CHECK_BUDGET (seconds for all stages, 520), GPU_CHECK_TEST_WORKERS (pytest-xdist
# workers, 12; 0 = one process), GPU_CHECK_TEST_CAP (the tests stage's limit, 300), GPU_CHECK_BENCH_ARGS (extra bench_ring_gpu.py
# arguments, e.g. --all), GPU_CHECK_TESTS (the pytest paths, tests), CPLIB_QUICK_TESTS
# (passed on to the suite; 1 unless set: the CPU-only matrices in their quick form).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-16}
# A compiler that links libstdc++ dynamically, whatever CXX the environment
# exports: GPU images export CXX=/opt/gcc/bin/g++, which links it statically
# (the build would be refused). build_support/libstdcxx.py keeps CXX when it
# qualifies, else takes the system compiler (/usr/bin/g++ first).
if CHOSEN=$("$PY" build_support/libstdcxx.py 2>&1); then
  read -r CC CXX <<<"$(head -n 1 <<<"$CHOSEN")"
  COMPILER_WHY=$(tail -n 1 <<<"$CHOSEN")
  export CC CXX
else
  COMPILER_WHY="no compiler qualifies: $CHOSEN"
  export CC=${CC:-/usr/bin/gcc} CXX=${CXX:-/usr/bin/g++}
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET:-520}  # under one 540 s device call, with the stages' kill grace
WORKERS=${GPU_CHECK_TEST_WORKERS:-12}
# The tests stage: at most TEST_CAP s in all, no test started in its last
# TEST_TAIL s, none running longer than TEST_TIMEOUT s.
TEST_CAP=${GPU_CHECK_TEST_CAP:-300} TEST_TAIL=${GPU_CHECK_TEST_TAIL:-60} TEST_TIMEOUT=120
OUT_DIR=${OUT:-$ROOT/benchmarks/out/gpu-check}
ALL_STAGES="build tests memcheck demo bench"
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
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
START=$(date +%s)
DEADLINE=$((START + BUDGET))
declare -a SUMMARY=()
FAILED=0
SKIPPED=0
RC=0 SECS=0 LIMIT=0

note() { printf '[gpu-check %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }

have_gpu() {
  # GPU_CHECK_ASSUME_GPU=1 runs the GPU stages anyway (to test this script's
  # failure handling on a machine without one).
  [[ ${GPU_CHECK_ASSUME_GPU:-0} == 1 ]] && return 0
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

# record STAGE RESULT SECONDS DETAILS
record() {
  SUMMARY+=("$(printf '%-9s %-5s %6s  %s' "$1" "$2" "$3" "$4")")
  case $2 in FAIL) FAILED=1 ;; SKIP) SKIPPED=1 ;; esac
  note "$1: $2 ($3 s) $4"
}

# Copies the main files next to the logs' tarball; run after every stage so
# that a run cut short still leaves its logs behind.
bundle() {
  [[ -f $LOGS/tests.log ]] && cp "$LOGS/tests.log" "$OUT_DIR/"
  [[ -f $LOGS/bench.log ]] && cp "$LOGS/bench.log" "$OUT_DIR/bench_ring_gpu.log"
  tar -czf "$OUT_DIR/gpu-check-logs.tar.gz" -C "$LOGS" . 2>/dev/null
}

# run_limited STAGE CAP LOG CMD...: runs CMD with the stage's time limit
# (its cap, or what is left of the budget); sets RC and SECS.
run_limited() {
  local stage=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((cap < left ? cap : left))
  if ((DRY)); then
    printf '  %-9s (limit %ss): %s\n' "$stage" "$cap" "$*"
    RC=0 SECS=0
    return
  fi
  if ((limit < 5)); then
    echo "no time left of the ${BUDGET}s budget" >"$log"
    RC=125 SECS=0
    return
  fi
  local t0
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  RC=$?
  SECS=$(($(date +%s) - t0))
  LIMIT=$limit
}

why() {  # a failed command's reason, from its exit status and log
  case $RC in
    124|137) echo "timed out after ${LIMIT}s" ;;
    125) echo "not run: no time left of the ${BUDGET}s budget" ;;
    *) # the last error line (an exception, torchrun's cause), else the last line
       local line
       line=$(grep -E '^[A-Za-z_.]*(Error|Exception)\b|error: ' "$1" | grep -v '^torch.distributed.elastic' | tail -n 1)
       [[ -n $line ]] || line=$(grep -Ev '^\s*$|^=+' "$1" | tail -n 1)
       echo "exit $RC: $(cut -c1-150 <<<"$line")" ;;
  esac
}

# ------------------------------------------------------------------ stages

stage_build() {
  local log=$LOGS/build.log missing=""
  for c in "$CC" "$CXX"; do command -v "$c" >/dev/null || missing+=" $c"; done
  if [[ -n $missing ]] && ((!DRY)); then
    record build FAIL 0 "compiler not found:$missing (set CC/CXX to a GCC whose libstdc++ is shared)"
    return
  fi
  local cuda=0
  ((GPU)) && cuda=1
  run_limited build 240 "$log" env CPLIB_CUDA=$cuda "$PY" setup.py build_ext --inplace
  ((DRY)) && return
  if ((RC != 0)); then record build FAIL "$SECS" "$(why "$log")"; return; fi
  # The extension must use the shared libstdc++ (setup.py
  # refuses such a build too), carry the CUDA kernels when a GPU is there, and
  # turn bad input into a ValueError.
  local so
  so=$(ls cplib/_C*.so 2>/dev/null | head -n 1)
  if ! "$PY" - "$cuda" "$so" >>"$log" 2>&1 <<'EOF'
import sys, torch
from build_support.libstdcxx import carries_private_libstdcxx
if carries_private_libstdcxx(sys.argv[2]):
    raise SystemExit(f"{sys.argv[2]} carries its own libstdc++: rebuild with CXX=/usr/bin/g++")
import cplib
if sys.argv[1] == "1":
    assert torch._C._dispatch_has_kernel_for_dispatch_key("cplib_c::ring_sdpa", "CUDA"), \
        "cplib was built without its CUDA kernels"
try:
    cplib.merge_partial_(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2), torch.zeros(1, 1, 5, 3),
                         torch.zeros(1, 1, 5), 0)
except ValueError as exc:
    print("bad input raised ValueError:", str(exc).splitlines()[0])
else:
    raise SystemExit("bad input did not raise ValueError")
EOF
  then
    record build FAIL "$SECS" "post-build check failed: $(tail -n 1 "$log" | cut -c1-150)"
    return
  fi
  record build PASS "$SECS" "$(basename "$so") with $CXX, MAX_JOBS=$MAX_JOBS, CUDA=$cuda; bad input -> ValueError"
}

# The suite in at most TEST_CAP seconds on WORKERS xdist workers: the tests
# that need a GPU first, then as much of the rest as fits; no test starts in
# the last TEST_TAIL seconds (budget_plugin.py skips them as "left out"), and
# a hard limit kills whatever still runs. Every result is written as it
# arrives, so the counts and the failing tests' names survive a kill.
stage_tests() {
  local log=$LOGS/tests.log progress=$LOGS/tests-progress.jsonl
  local args=(-q -rfE -p no:cacheprovider -p benchmarks.gpu.budget_plugin --junitxml="$LOGS/junit.xml")
  local how="1 process"
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then args+=(--timeout "$TEST_TIMEOUT"); fi
  if ((WORKERS > 0)) && "$PY" -c 'import xdist' 2>/dev/null; then
    args+=(-n "$WORKERS" --dist load); how="$WORKERS workers"
  elif ((WORKERS > 0)); then
    how="1 process (pytest-xdist missing)"
  fi
  "$PY" -c 'import pytest' 2>/dev/null || ((DRY)) || { record tests FAIL 0 "pytest is not installed for $PY"; return; }
  local left=$((DEADLINE - $(date +%s))) cap=$TEST_CAP
  ((left < cap)) && cap=$left
  rm -f "$progress" "$progress.collected"
  # shellcheck disable=SC2086  # GPU_CHECK_TESTS is a list of paths
  # The CPU-only matrices in their quick form (CI runs them whole); inductor
  # compiles in-process (tests/conftest.py sets that too).
  run_limited tests "$cap" "$log" env CPLIB_TEST_RUN_TIMEOUT=200 CPLIB_TEST_RANK_TIMEOUT=90 \
    CPLIB_QUICK_TESTS="${CPLIB_QUICK_TESTS:-1}" TORCHINDUCTOR_COMPILE_THREADS=1 \
    CPLIB_TEST_PROGRESS="$progress" CPLIB_TEST_START_DEADLINE=$(($(date +%s) + cap - TEST_TAIL)) \
    "$PY" -m pytest "${args[@]}" ${GPU_CHECK_TESTS:-tests}
  ((DRY)) && return
  "$PY" benchmarks/gpu/budget_plugin.py "$progress" >"$LOGS/tests-summary.txt" 2>&1
  cp "$LOGS/tests-summary.txt" "$OUT_DIR/tests_summary.txt"
  local counts
  counts="$(head -n 1 "$LOGS/tests-summary.txt"); $how"
  if ((RC == 0)); then record tests PASS "$SECS" "$counts"
  else record tests FAIL "$SECS" "$counts; $(why "$log")"; fi
}

stage_demo() {
  local log=$LOGS/demo.log
  if ((!GPU)) && ((!DRY)); then record demo SKIP 0 "no CUDA GPU visible"; return; fi
  run_limited demo 120 "$log" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    examples/demo.py --device cuda --out "$OUT_DIR/demo_loss.png"
  ((DRY)) && return
  local verdict
  verdict=$(grep -m1 '^demo verdict:' "$log" | cut -c1-160)
  if ((RC == 0)) && [[ $verdict == "demo verdict: PASS"* ]]; then
    record demo PASS "$SECS" "$(grep -m1 '^throughput' "$log"); ${verdict#demo verdict: }"
  else
    record demo FAIL "$SECS" "${verdict:-$(why "$log")}"
  fi
}

stage_bench() {
  local log=$LOGS/bench.log
  if ((!GPU)) && ((!DRY)); then record bench SKIP 0 "no CUDA GPU visible"; return; fi
  # The bench stops starting configurations 30 s before its limit, so that it
  # always gets to write its tables, JSON and PNG.
  local cap=240 left=$((DEADLINE - $(date +%s)))
  ((left < cap)) && cap=$left
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of arguments
  run_limited bench 240 "$log" env CPLIB_BENCH_OUT="$OUT_DIR" CPLIB_BENCH_REQUIRE_GPU=1 \
    "$PY" benchmarks/bench_ring_gpu.py --budget $((cap > 60 ? cap - 30 : 30)) \
    --results "$OUT_DIR/gpu.json" ${GPU_CHECK_BENCH_ARGS:-}
  ((DRY)) && return
  # bench_merge.py times the C merge on the CPU only; the CUDA merge kernel's
  # bandwidth is part of bench_ring_gpu.py.
  local goals
  goals=$(awk '/^### goals/{f=1;next} /^###/{f=0} f && /\| (yes|NO) *\|$/' "$log" |
          awk '{n++} /\| yes *\|$/{m++} END{printf "goals met %d of %d", m, n}')
  if ((RC == 0)) && [[ -f $OUT_DIR/bench_ring_gpu.json ]]; then
    local errs
    errs=$(grep -c 'error: \|NaN/inf' "$log")
    record bench PASS "$SECS" "$goals; $errs cells with errors or NaN (see bench_ring_gpu.log)"
  else
    record bench FAIL "$SECS" "$(why "$log")"
  fi
}

stage_memcheck() {
  local sanitizer
  if ((!GPU)) && ((!DRY)); then record memcheck SKIP 0 "no CUDA GPU visible"; return; fi
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ -z $sanitizer ]]; then
    ((DRY)) && sanitizer=compute-sanitizer || { record memcheck FAIL 0 "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"; return; }
  fi
  # Without the caching allocator each tensor is its own allocation, so
  # memcheck sees an access past any tensor's end.
  local cmd=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --error-exitcode 86)
  local pytest=("$PY" -m pytest -q -p no:cacheprovider)
  MC_SECS=0 MC_FAILED="" MC_NOTES=()
  # 1. cplib's CUDA kernels (merge, halo) against their C twins;
  memcheck_run kernels "${cmd[@]}" "$PY" benchmarks/gpu/kernels_check.py
  # 2. the ring's block backward through the flash and efficient kernels, one
  #    step at a time (an efficient-backend bug read past `out`);
  memcheck_run ring-steps "${cmd[@]}" "${pytest[@]}" tests/test_ring_sdpa_threaded.py \
    -k "per_step_cuda and not cudnn"
  # 3. the kernels' own test files' CUDA cases, where they have any.
  if ((!DRY)) && "${pytest[@]}" --collect-only -k cuda tests/test_merge.py tests/test_halo.py >/dev/null 2>&1; then
    memcheck_run kernel-tests "${cmd[@]}" "${pytest[@]}" -k cuda tests/test_merge.py tests/test_halo.py
  fi
  ((DRY)) && return
  local details
  details=$(printf '%s; ' "${MC_NOTES[@]}")
  details=${details%; }
  if [[ -z $MC_FAILED ]]; then record memcheck PASS "$MC_SECS" "$details"
  else record memcheck FAIL "$MC_SECS" "$details"; fi
}

# memcheck_run NAME CMD...: one compute-sanitizer run of the memcheck stage.
memcheck_run() {
  local name=$1 log=$LOGS/memcheck-$1.log errs; shift
  run_limited memcheck 150 "$log" "$@"
  ((DRY)) && return
  MC_SECS=$((MC_SECS + SECS))
  errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | awk '{s+=$3} END{print s+0}')
  local ran
  ran=$(grep -Eo '^kernels_check: .* cases OK|[0-9]+ (passed|failed|skipped)' "$log" |
        sed 's/^kernels_check: //; s/ OK$//' | paste -sd, -)
  if ((RC == 0)); then
    MC_NOTES+=("$name: $errs errors (${ran:-nothing reported})")
  else
    MC_NOTES+=("$name: $errs errors (${ran:-nothing reported}), $(why "$log")")
    MC_FAILED+=" $name"
  fi
}

# ------------------------------------------------------------------ main

GPU=0
if ((DRY)); then
  GPU=1
  echo "gpu-check dry run: stages '$STAGES', output $OUT_DIR, budget ${BUDGET}s, PYTHON=$PY CC=$CC CXX=$CXX MAX_JOBS=$MAX_JOBS"
  echo "compiler: $COMPILER_WHY"
elif have_gpu; then
  GPU=1
fi
{
  date -u +"%Y-%m-%d %H:%M UTC"
  uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
  command -v nvcc && nvcc --version | tail -n 1
  "$CXX" --version 2>&1 | head -n 1
  for m in pytest xdist pytest_timeout matplotlib ninja; do
    "$PY" -c "import $m" 2>/dev/null && echo "$m: yes" || echo "$m: MISSING"
  done
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
} >"$LOGS/env.txt" 2>&1
DEVICE=$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU", "| torch", torch.__version__)' 2>&1 | tail -n 1)
((DRY)) || note "device: $DEVICE; output: $OUT_DIR; budget ${BUDGET}s; compiler: $COMPILER_WHY"
((GPU)) || note "no CUDA GPU visible: the GPU stages (memcheck, demo, bench) are skipped"

for s in $ALL_STAGES; do
  if [[ " $STAGES " == *" $s "* ]]; then
    ((DRY)) || note "$s ..."
    "stage_$s"
    ((DRY)) || bundle
  fi
done
((DRY)) && { rm -rf "$LOGS"; exit 0; }

TOTAL=$(($(date +%s) - START))
{
  echo "=== GPU check summary: $DEVICE, $(date -u +"%Y-%m-%d %H:%M UTC")"
  printf '%-9s %-5s %6s  %s\n' stage result secs details
  printf '%s\n' "${SUMMARY[@]}"
  if ((FAILED)); then RESULT=FAIL; elif ((SKIPPED)); then RESULT="INCOMPLETE (stages skipped)"; else RESULT=PASS; fi
  printf '%-9s %-5s %6s  %s\n' total "$RESULT" "$TOTAL" "output in $OUT_DIR"
} >"$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$OUT_DIR/summary.txt"
bundle
rm -rf "$LOGS"

# The end of the bench's tables and the failing tests, then the summary.
if [[ -f $OUT_DIR/bench_ring_gpu.log ]]; then
  echo; awk '/^### goals/{f=1} f' "$OUT_DIR/bench_ring_gpu.log" | head -n 40
fi
if [[ -f $OUT_DIR/tests_summary.txt ]]; then  # written even when the stage timed out
  echo; tail -n +2 "$OUT_DIR/tests_summary.txt" | cut -c1-300 | head -n 30
fi
echo
cat "$OUT_DIR/summary.txt"
((FAILED)) && exit 1
((SKIPPED)) && exit 2
exit 0

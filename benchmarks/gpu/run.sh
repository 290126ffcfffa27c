#!/usr/bin/env bash
# The GPU check (`make gpu-check`): one command on a GPU machine, GPU work only,
# each stage under its own time limit and the whole under GPU_CHECK_BUDGET (530 s):
#   install  the prepared CUDA wheel (.gpu-prep/, from `make gpu-prep` where .git
#            is) installed beside the machine's torch (pip --no-deps, no network),
#            proven to be the wheel's extension byte for byte
#            (build_support/check_wheel.py) and built from the tree's sources
#            (build_support/gpu_prep.py check); the commit comes from
#            .gpu-prep/prep.json. Without a prepared wheel: the extension built in
#            place with a compiler that links libstdc++ dynamically
#            (build_support/libstdcxx.py), and the commit recorded as unknown, with
#            the reason (git's HEAD where the tree has its .git);
#   tests    the CUDA tests, selected by their marker (pytest -m cuda), results
#            written as they arrive (budget_plugin.py), on GPU_CHECK_TEST_WORKERS
#            pytest-xdist workers;
#   bench    benchmarks/bench_ring_gpu.py: every cell in a worker process with its
#            own limit (30 s), its JSON rewritten after every cell;
#   memcheck compute-sanitizer over cplib's CUDA kernels (merge, halo) against
#            their C twins, the ring's per-step block backward, and tp_convolution
#            through the op on CUDA; a step that selects nothing fails;
#   demo     examples/demo.py --device cuda (torchrun, NCCL, one rank).
# Every stage runs even after another failed. A stage is PASS only when all of it
# ran and passed: a test skipped, left out or unfinished, a benchmark cell with
# an error, NaN, time-out or skip makes it INCOMPLETE (or FAIL), and the summary
# names them. Without a GPU the tests stage runs (its tests skip) and the others
# are skipped: the verdict is INCOMPLETE, exit status 2.
#
# Output: $OUT when set, else benchmarks/out/gpu-check/; at most 8 files, flat:
# summary.txt, tests_summary.txt, bench_ring_gpu.log, bench_ring_gpu.json and
# gpu-check-files.tar.gz (gpu.json, the PNGs, every log). Exit status: 0 PASS,
# 1 FAIL, 2 INCOMPLETE.
#
#   benchmarks/gpu/run.sh                      # everything (about 7 minutes on an H100)
#   benchmarks/gpu/run.sh --dry-run            # print what would run, run nothing
#   benchmarks/gpu/run.sh --stages install,tests
#
# Environment: PYTHON (python3), GPU_CHECK_PREP (the prepared folder, .gpu-prep),
# GPU_CHECK_BUDGET (530), GPU_CHECK_TEST_WORKERS (8; 0 = one process), MAX_JOBS (16),
# CC / CXX (for the in-place build), GPU_CHECK_BENCH_ARGS (more bench_ring_gpu.py
# arguments), GPU_CHECK_ASSUME_GPU=1 (run the GPU stages without a GPU: tests this
# script's failure paths), GPU_CHECK_SKIP_BUILD=1 (no prepared wheel: use the cplib
# python already finds instead of building; tests/gpu/test_gpu_check.py uses it).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
PREP=${GPU_CHECK_PREP:-$ROOT/.gpu-prep}
OUT_DIR=${OUT:-$ROOT/benchmarks/out/gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-530}
WORKERS=${GPU_CHECK_TEST_WORKERS:-8}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
declare -A CAP=([install]=120 [tests]=160 [bench]=150 [memcheck]=60 [demo]=40)
ALL_STAGES="install tests bench memcheck demo"
FLAT="summary.txt tests_summary.txt bench_ring_gpu.log bench_ring_gpu.json gpu-check-files.tar.gz"
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
RESULT=PASS RC=0 SECS=0 LIMIT=0
WHEEL=$(ls "$PREP"/cplib-*.whl 2>/dev/null | head -n 1)
COMMIT=$("$PY" build_support/gpu_prep.py commit ${WHEEL:+"$PREP"} 2>&1 | tail -n 1)
export CPLIB_COMMIT=$COMMIT

note() { printf '[gpu-check %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }

# record STAGE VERDICT SECONDS DETAILS: VERDICT is PASS, FAIL, INCOMPLETE or SKIP.
record() {
  SUMMARY+=("$(printf '%-9s %-10s %5s  %s' "$1" "$2" "$3" "$4")")
  case $2 in
    FAIL) RESULT=FAIL ;;
    INCOMPLETE|SKIP) [[ $RESULT == FAIL ]] || RESULT=INCOMPLETE ;;
  esac
  note "$1: $2 ($3 s) $4"
}

# run_limited STAGE CAP LOG CMD...: CMD under the stage's limit (its cap, or what
# is left of the budget); sets RC, SECS and LIMIT.
run_limited() {
  local stage=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE - $(date +%s)))
  LIMIT=$((cap < left ? cap : left))
  if ((DRY)); then printf '  %-9s (limit %ss): %s\n' "$stage" "$cap" "$*"; RC=0 SECS=0; return; fi
  if ((LIMIT < 5)); then echo "no time left of the ${BUDGET}s budget" >"$log"; RC=125 SECS=0; return; fi
  local t0
  t0=$(date +%s)
  timeout -k 10 "$LIMIT" "$@" >"$log" 2>&1
  RC=$?
  SECS=$(($(date +%s) - t0))
}

why() {  # a failed command's reason, from its exit status and log
  case $RC in
    124|137) echo "timed out after ${LIMIT}s" ;;
    125) echo "not run: no time left of the ${BUDGET}s budget" ;;
    *) local line
       line=$(grep -E '^[A-Za-z_.]*(Error|Exception)\b|error: ' "$1" | grep -v '^torch.distributed.elastic' | tail -n 1)
       [[ -n $line ]] || line=$(grep -Ev '^\s*$|^=+' "$1" | tail -n 1)
       echo "exit $RC: $(cut -c1-150 <<<"$line")" ;;
  esac
}

source "$ROOT/benchmarks/gpu/stages.sh"

# ------------------------------------------------------------------ main

# One python start for the device and the environment (torch takes seconds to import).
"$PY" - >"$LOGS/probe.txt" 2>&1 <<'EOF'
import importlib.util, sys
import torch
gpu = torch.cuda.is_available()
print(f"{torch.cuda.get_device_name() if gpu else 'no CUDA GPU'} | torch {torch.__version__}")
print(int(gpu))
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
for m in ("pytest", "xdist", "pytest_timeout", "matplotlib", "ninja"):
    print(f"{m}: {'yes' if importlib.util.find_spec(m) else 'MISSING'}")
EOF
DEVICE=$(sed -n 1p "$LOGS/probe.txt")
GPU=$(sed -n 2p "$LOGS/probe.txt")
[[ $GPU == 1 ]] || GPU=0
[[ ${GPU_CHECK_ASSUME_GPU:-0} == 1 ]] && GPU=1  # the GPU stages without a GPU: their failure paths
((DRY)) && GPU=1
{
  date -u +"%Y-%m-%d %H:%M UTC"; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  tail -n +3 "$LOGS/probe.txt"
  command -v nvcc && nvcc --version | tail -n 1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  echo "commit: $COMMIT"; [[ -n $WHEEL ]] && cat "$PREP/prep.json"
} >"$LOGS/env.txt" 2>&1
if ((DRY)); then
  echo "gpu-check dry run: stages '$STAGES', output $OUT_DIR, budget ${BUDGET}s, PYTHON=$PY, prepared wheel: ${WHEEL:-none}"
  echo "commit: $COMMIT"
else
  note "device: $DEVICE; commit: $COMMIT; output: $OUT_DIR; budget ${BUDGET}s"
  ((GPU)) || note "no CUDA GPU visible: the tests stage's tests skip, bench, memcheck and demo are skipped"
fi

# The summary and the archive, rewritten after every stage: a run cut short
# still leaves what it found ($1: the stages not yet run).
write_outputs() {
  local verdict=$RESULT
  [[ -n $1 ]] && verdict="$RESULT so far (cut short before: $1)"
  {
    echo "=== GPU check: $verdict; $DEVICE; $(date -u +"%Y-%m-%d %H:%M UTC")"
    echo "commit: $COMMIT"
    printf '%-9s %-10s %5s  %s\n' stage result secs details
    printf '%s\n' "${SUMMARY[@]}"
    printf '%-9s %-10s %5s  %s\n' total "$RESULT" "$(($(date +%s) - START))" \
      "budget ${BUDGET}s; stages run: $STAGES"
    if [[ $RESULT != PASS ]]; then
      echo; echo "not PASS because:"; printf '%s\n' "${DETAILS[@]}"
    fi
  } >"$LOGS/summary.txt"
  bundle
  cp "$LOGS/summary.txt" "$OUT_DIR/summary.txt"
  local count
  count=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
  echo "files in the output folder: $count (at most 8 come back): $(cd "$OUT_DIR" && ls | tr '\n' ' ')" \
    >>"$OUT_DIR/summary.txt"
}

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
rm -rf "$LOGS"

if [[ -f $OUT_DIR/bench_ring_gpu.log ]]; then
  echo; awk '/^### goals/{f=1} f' "$OUT_DIR/bench_ring_gpu.log" | head -n 30
fi
echo; cat "$OUT_DIR/summary.txt"
case $RESULT in PASS) exit 0 ;; FAIL) exit 1 ;; *) exit 2 ;; esac

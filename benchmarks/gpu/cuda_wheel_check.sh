#!/usr/bin/env bash
# The CUDA wheel on a GPU machine, as users get it: dist/cuda/cplib-*.whl (from
# `make cuda-wheel` here, carried to the GPU machine, NOT rebuilt there)
# installed beside that machine's torch, then
#   1. build_support/check_wheel.py: the extension imported is the wheel's, byte for byte;
#   2. the tests that need a GPU (the CUDA matrices, the CUDA glue probes on
#      CUDA tensors) and tests/test_cuda_glue.py, on 12 workers, at most 300 s;
#   3. benchmarks/bench_ring_gpu.py, which writes gpu.json (device, torch,
#      commit, date, rows) to the output folder: copy it to
#      benchmarks/results/gpu.json. Pass CPLIB_COMMIT (the tree travels without .git).
# Output ($OUT, else benchmarks/out/cuda-wheel/): tests.log, tests_summary.txt,
# bench.log, gpu.json. Exit status 0 only if every step passed.
#
#   benchmarks/gpu/cuda_wheel_check.sh [--dry-run]
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/benchmarks/out/cuda-wheel}
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
WHEEL=$(ls dist/cuda/cplib-*-abi3-*.whl 2>/dev/null | head -n 1)
[[ -n $WHEEL ]] || { echo "cuda_wheel_check: no dist/cuda/cplib-*-abi3-*.whl (make cuda-wheel here, carry dist/cuda)" >&2; exit 64; }
SITE=${CPLIB_WHEEL_SITE:-/tmp/cplib-cuda-wheel}
WORKERS=${GPU_CHECK_TEST_WORKERS:-12}
mkdir -p "$OUT_DIR"
run() { if ((DRY)); then echo "  $*"; else "$@"; fi; }
FAILED=0

echo "cuda_wheel_check: $WHEEL -> $SITE; output $OUT_DIR"
run "$PY" -m pip install -q --no-deps --no-index --force-reinstall --target "$SITE" "$WHEEL" || exit 1
# The wheel's cplib, never the source tree's: -P keeps the current folder off
# sys.path, and the checks run from elsewhere.
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run bash -c "cd / && '$PY' -P '$ROOT/build_support/check_wheel.py' '$ROOT/$WHEEL'" || FAILED=1

progress=$OUT_DIR/tests-progress.jsonl
rm -f "$progress" "$progress.collected"
xdist=()  # pytest-xdist and pytest-timeout arguments, where installed
"$PY" -c 'import xdist' 2>/dev/null && xdist=(-n "$WORKERS" --dist load)
"$PY" -c 'import pytest_timeout' 2>/dev/null && xdist+=(--timeout 120)
# budget_plugin (GPU tests first, results written as they arrive) from its
# own folder: benchmarks/ is no package of the wheel.
run env PYTHONPATH="$ROOT/benchmarks/gpu:$PYTHONPATH" CPLIB_TEST_PROGRESS="$progress" \
  CPLIB_TEST_START_DEADLINE=$(($(date +%s) + 240)) TORCHINDUCTOR_COMPILE_THREADS=1 \
  timeout -k 10 300 "$PY" -P -m pytest -q -rfE -p no:cacheprovider -p budget_plugin "${xdist[@]}" \
  tests -k "cuda or glue" >"$OUT_DIR/tests.log" 2>&1 || FAILED=1
if ((!DRY)); then
  "$PY" "$ROOT/benchmarks/gpu/budget_plugin.py" "$progress" | tee "$OUT_DIR/tests_summary.txt"
fi

run env CPLIB_BENCH_OUT="$OUT_DIR" CPLIB_BENCH_REQUIRE_GPU=1 timeout -k 10 220 \
  "$PY" -P benchmarks/bench_ring_gpu.py --budget 180 --results "$OUT_DIR/gpu.json" \
  >"$OUT_DIR/bench.log" 2>&1 || FAILED=1
((DRY)) || tail -n 30 "$OUT_DIR/bench.log"
((DRY)) || ls -l "$OUT_DIR"
exit $FAILED

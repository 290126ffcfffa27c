# The stages of the GPU check, sourced by benchmarks/gpu/run.sh (which sets
# PY, ROOT, LOGS, OUT_DIR, CAP, GPU, DRY, WHEEL, PREP, COMMIT and the helpers
# record, detail, run_limited, settle, why, note). Each stage records one
# verdict line and, when not PASS, the names of what did not pass (DETAILS).
# A verdict always goes through settle: a command that exited non-zero is
# FAIL, one out of time INCOMPLETE, whatever its output says.

# install: the prepared wheel, else the extension built in place.
stage_install() {
  local log=$LOGS/install.log cuda=""
  ((GPU)) && cuda=--cuda
  if [[ -n $WHEEL ]]; then
    run_limited install "${CAP[install]}" "$log" "$PY" benchmarks/gpu/install_check.py wheel \
      "$WHEEL" "$LOGS/site" "$PREP" $cuda
    ((DRY)) && return
    export PYTHONPATH="$LOGS/site"
    local verdict
    verdict=$(settle PASS)
    if [[ $verdict == PASS ]]; then
      record install PASS "$SECS" "$(basename "$WHEEL") beside the machine's torch: the wheel's extension byte for byte, built from these sources"
    else
      record install "$verdict" "$SECS" "$(why "$log")"
      detail install "$(why "$log"); $(grep -E '^check_wheel:|^gpu_prep:|Error|carries' "$log" | head -n 3 | tr '\n' ' ')"
    fi
    return
  fi
  export PYTHONPATH="$ROOT"
  if [[ ${GPU_CHECK_SKIP_BUILD:-0} == 1 ]]; then
    export PYTHONPATH=""
    record install SKIP 0 "no prepared wheel and GPU_CHECK_SKIP_BUILD=1: nothing built, the cplib python finds is used"
    detail install "no prepared wheel (make gpu-prep) and no build"
    return
  fi
  local chosen cc cxx reason
  if chosen=$("$PY" build_support/libstdcxx.py 2>&1); then
    read -r cc cxx <<<"$(head -n 1 <<<"$chosen")"
    reason=$(tail -n 1 <<<"$chosen")
  else
    cc=${CC:-/usr/bin/gcc} cxx=${CXX:-/usr/bin/g++} reason="no compiler qualifies: $chosen"
  fi
  ((DRY)) && echo "compiler: CC=$cc CXX=$cxx; $reason"
  run_limited install "${CAP[install]}" "$log" env CC="$cc" CXX="$cxx" CPLIB_CUDA=$GPU \
    "$PY" setup.py build_ext --inplace
  ((DRY)) && return
  if [[ $OUTCOME != ok ]]; then
    record install "$(settle PASS)" "$SECS" "in-place build with $cxx: $(why "$log")"
    detail install "the build did not finish: $(why "$log") (install.log in the archive)"
    return
  fi
  if "$PY" benchmarks/gpu/install_check.py built $cuda >>"$log" 2>&1; then
    record install PASS "$SECS" "no prepared wheel: built in place with $cxx ($reason), CUDA=$GPU"
  else
    record install FAIL "$SECS" "post-build check: $(tail -n 1 "$log" | cut -c1-150)"
    detail install "the built extension failed its checks"
  fi
}

# pytest_stage STAGE MARKS WORKERS TIMEOUT [VAR=VALUE...]: the CUDA tests
# MARKS selects, on WORKERS pytest-xdist workers (0: one process), each test
# under TIMEOUT seconds, the environment's VAR=VALUE added; results written
# as they arrive (budget_plugin.py) and summed up in $LOGS/STAGE_summary.txt.
pytest_stage() {
  local stage=$1 marks=$2 workers=$3 timeout=$4; shift 4
  local log=$LOGS/$stage.log progress=$LOGS/$stage-progress.jsonl how="1 process"
  local args=(-q -rfEs -p no:cacheprovider -p budget_plugin -m "$marks" --junitxml="$LOGS/$stage-junit.xml")
  "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout "$timeout")
  if ((workers > 0)) && "$PY" -c 'import xdist' 2>/dev/null; then
    args+=(-n "$workers" --dist load); how="$workers workers"
  fi
  local cap=${CAP[$stage]} left=$((DEADLINE - $(date +%s)))
  ((left < cap)) && cap=$left
  rm -f "$progress" "$progress.collected"
  # -P: the tree's cplib/ never shadows the installed one; budget_plugin from its folder.
  run_limited "$stage" "$cap" "$log" env PYTHONPATH="$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}" \
    CPLIB_TEST_RUN_TIMEOUT=$((timeout - 20)) CPLIB_TEST_RANK_TIMEOUT=60 CPLIB_TEST_PROGRESS="$progress" \
    CPLIB_TEST_START_DEADLINE=$(($(date +%s) + cap - 20)) "$@" \
    "$PY" -P -m pytest "${args[@]}" "$ROOT/tests"
  ((DRY)) && return
  {
    echo "CUDA tests (pytest -m '$marks', $how); commit: $COMMIT"
    "$PY" benchmarks/gpu/budget_plugin.py "$progress"
  } >"$LOGS/${stage}_summary.txt" 2>&1
  local counts verdict why_not=""
  counts=$(sed -n 2p "$LOGS/${stage}_summary.txt")
  verdict=$(settle "$("$PY" benchmarks/gpu/budget_plugin.py --verdict "$progress")")
  [[ $OUTCOME == ok ]] || why_not="pytest: $(why "$log"); "
  record "$stage" "$verdict" "$SECS" "$why_not$counts"
  [[ $verdict == PASS ]] || detail "$stage" "$why_not$(tail -n +3 "$LOGS/${stage}_summary.txt" | cut -c1-300 | head -n 12 | sed '2,$s/^/    /')"
}

# tests: the CUDA tests, selected by their marker, but those that compile
# Triton kernels for several rank threads (the compile stage's).
stage_tests() {
  pytest_stage tests "cuda and not cuda_compile" "$WORKERS" 120
}

# compile: the CUDA tests that compile Triton kernels for several rank
# threads (marker cuda_compile), one worker each, alone on the machine, with
# inductor's parallel compile: in the tests stage (one compile thread, 8
# workers sharing the cores) they ran out of their 120 s.
stage_compile() {
  ((DRY)) || gpu_only compile || return
  pytest_stage compile cuda_compile 2 "${CAP[compile]}" TORCHINDUCTOR_COMPILE_THREADS=8
}

gpu_only() {  # gpu_only STAGE: records SKIP and returns 1 without a GPU
  if ((!GPU)); then
    record "$1" SKIP 0 "no CUDA GPU visible"
    detail "$1" "skipped: no CUDA GPU visible"
    return 1
  fi
}

stage_bench() {
  ((DRY)) || gpu_only bench || return
  local log=$LOGS/bench_ring_gpu.log cap=${CAP[bench]} left=$((DEADLINE - $(date +%s)))
  ((left < cap)) && cap=$left
  mkdir -p "$LOGS/bench"
  # Cells stop starting 25 s before the limit, so the tables, JSON and PNG get written.
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of arguments
  run_limited bench "$cap" "$log" env CPLIB_BENCH_OUT="$LOGS/bench" CPLIB_BENCH_REQUIRE_GPU=1 \
    "$PY" -P benchmarks/bench_ring_gpu.py --budget $((cap > 60 ? cap - 25 : 30)) --cell-timeout 30 \
    --results "$LOGS/bench/gpu.json" ${GPU_CHECK_BENCH_ARGS:-}
  ((DRY)) && return
  # The JSON's verdict (its cells), then the benchmark's own exit status:
  # a benchmark that fails after its JSON is complete still fails.
  local json=$LOGS/bench/bench_ring_gpu.json report head kind
  report=$("$PY" benchmarks/gpu/ring_report.py verdict "$json" 2>&1)
  head=${report%%$'\n'*}
  kind=$(settle "${head%%:*}")
  local why_not=""
  [[ $OUTCOME == ok ]] || why_not="; the benchmark: $(why "$log")"
  record bench "$kind" "$SECS" "${head#*: }$why_not"
  local cells
  cells=$(tail -n +2 <<<"$report" | cut -c1-300 | head -n 12 | sed '2,$s/^/    /')
  [[ $kind == PASS ]] || detail bench "${cells:-${head#*: }}$why_not"
}

stage_memcheck() {
  ((DRY)) || gpu_only memcheck || return
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [[ -n ${GPU_CHECK_FAKE_MEMCHECK:-} ]] && sanitizer=faked  # run_capped runs the fake instead
  if [[ -z $sanitizer ]]; then
    ((DRY)) && sanitizer=compute-sanitizer || {
      record memcheck FAIL 0 "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
      detail memcheck "compute-sanitizer not found"; return; }
  fi
  # Without the caching allocator each tensor is its own allocation, so
  # memcheck sees an access past any tensor's end.
  local cmd=(env PYTHONPATH="$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}" PYTORCH_NO_CUDA_MEMORY_CACHING=1
             "$sanitizer" --tool memcheck --error-exitcode 86)
  local pytest=("$PY" -P -m pytest -q -p no:cacheprovider -m cuda)
  MC_SECS=0 MC_FAILED="" MC_INCOMPLETE="" MC_NOTES=()
  # 1. cplib's CUDA kernels (merge, halo) against their C twins;
  memcheck_run kernels 25 "${cmd[@]}" "$PY" -P benchmarks/gpu/kernels_check.py
  # 2. the ring's block backward through the flash and efficient kernels, step by step;
  memcheck_run ring-steps 25 "${cmd[@]}" "${pytest[@]}" "$ROOT/tests/ring/test_ring_sdpa_threaded.py" \
    -k "per_step and not cudnn"
  # 3. tp_convolution through the op on CUDA (its halo kernels in place).
  memcheck_run conv-op 15 "${cmd[@]}" "${pytest[@]}" \
    "$ROOT/tests/conv/test_gpu_conv.py::test_tp_conv_on_gpu[2d-bf16-2]"
  ((DRY)) && return
  local details
  details=$(printf '%s; ' "${MC_NOTES[@]}")
  details=${details%; }
  if [[ -n $MC_FAILED ]]; then
    record memcheck FAIL "$MC_SECS" "$details"
    detail memcheck "failed:$MC_FAILED${MC_INCOMPLETE:+; incomplete:$MC_INCOMPLETE}"
  elif [[ -n $MC_INCOMPLETE ]]; then
    record memcheck INCOMPLETE "$MC_SECS" "$details"; detail memcheck "incomplete:$MC_INCOMPLETE"
  else
    record memcheck PASS "$MC_SECS" "$details"
  fi
}

# memcheck_run NAME CAP CMD...: one compute-sanitizer run. PASS needs exit 0,
# the sanitizer's "ERROR SUMMARY: 0 errors" (every such line 0: one per
# process it watched) and a case that ran, none skipped. An error counted,
# a non-zero exit or a run that selects nothing (pytest exit 5) fails; no
# ERROR SUMMARY line (the sanitizer did not finish its report), a skipped
# case or a run out of time is INCOMPLETE.
memcheck_run() {
  local name=$1 cap=$2 log=$LOGS/memcheck-$1.log summaries errs ran verdict=PASS why_not=""; shift 2
  run_limited memcheck "$cap" "$log" "$@"
  ((DRY)) && return
  MC_SECS=$((MC_SECS + SECS))
  summaries=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$log")
  errs=$(awk '{s+=$3} END{print s+0}' <<<"$summaries")
  ran=$(grep -Eo '^kernels_check: .* cases OK|[0-9]+ (passed|failed|skipped|deselected)' "$log" |
        sed 's/^kernels_check: //; s/ OK$//' | paste -sd, -)
  if ((errs > 0)); then verdict=FAIL why_not="$errs errors"
  elif [[ $OUTCOME != ok ]]; then verdict=$(settle INCOMPLETE) why_not=$(why "$log")
  elif [[ -z $ran ]]; then verdict=FAIL why_not="nothing ran"
  elif [[ -z $summaries ]]; then verdict=INCOMPLETE why_not="no ERROR SUMMARY line"
  elif grep -Eq '[0-9]+ skipped' <<<"$ran"; then verdict=INCOMPLETE why_not="a case skipped"
  fi
  if [[ $verdict == PASS ]]; then
    MC_NOTES+=("$name: $errs errors ($ran)")
  else
    MC_NOTES+=("$name: $verdict, ${why_not:-?} (${ran:-no case reported})")
    if [[ $verdict == FAIL ]]; then MC_FAILED+=" $name"; else MC_INCOMPLETE+=" $name"; fi
  fi
}

stage_demo() {
  ((DRY)) || gpu_only demo || return
  local log=$LOGS/demo.log
  run_limited demo "${CAP[demo]}" "$log" "$PY" -P -m torch.distributed.run --standalone \
    --nproc-per-node 1 examples/demo.py --device cuda --out "$LOGS/demo_loss.png"
  ((DRY)) && return
  local line verdict
  line=$(grep -m1 '^demo verdict:' "$log" | cut -c1-160)
  if [[ $line == "demo verdict: PASS"* ]]; then verdict=$(settle PASS)
  elif [[ -n $line ]]; then verdict=FAIL  # the demo's own verdict: it diverged
  else  # no verdict: out of time (INCOMPLETE), or it ended without one (FAIL)
    verdict=$(settle PASS); [[ $verdict == PASS ]] && verdict=FAIL
  fi
  if [[ $verdict == PASS ]]; then
    record demo PASS "$SECS" "$(grep -m1 '^throughput' "$log"); ${line#demo verdict: }"
  else
    local reason=${line:-$(why "$log")}
    [[ $OUTCOME == ok || -z $line ]] || reason+="; $(why "$log")"
    record demo "$verdict" "$SECS" "$reason"
    detail demo "$reason"
  fi
}

# The flat files, then one archive with everything else (gpu.json, PNGs, logs).
bundle() {
  local f
  for f in tests_summary.txt compile_summary.txt; do [[ -f $LOGS/$f ]] && cp "$LOGS/$f" "$OUT_DIR/"; done
  [[ -f $LOGS/bench_ring_gpu.log ]] && cp "$LOGS/bench_ring_gpu.log" "$OUT_DIR/"
  [[ -f $LOGS/bench/bench_ring_gpu.json ]] && cp "$LOGS/bench/bench_ring_gpu.json" "$OUT_DIR/"
  tar -czf "$OUT_DIR/gpu-check-files.tar.gz" -C "$LOGS" --exclude=./site --exclude=tests_summary.txt --exclude=compile_summary.txt \
    --exclude=bench_ring_gpu.log --exclude=bench_ring_gpu.json . 2>/dev/null
}

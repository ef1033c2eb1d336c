#!/usr/bin/env bash
# scripts/gpu-check.sh — every check of cudapool that needs a CUDA GPU, in one run, offline.
#
#   OUT=/some/dir bash scripts/gpu-check.sh        # OUT defaults to ./gpu-out
#
# 1. builds and installs the extension in place (pip, no build isolation, no dependencies,
#    no index: nothing is downloaded)                                    -> $OUT/build.log
# 2. prints what cudapool sees: `python3 -m cudapool info`, the GPU      -> $OUT/info.txt
# 2b. runs the C tests of the CUDA backend on the GPU (test_cuda_nodriver: the driver table,
#    events, plain segments and page-mapped memory through the VMM calls, which cudapool's
#    default policy rests on)                                             -> $OUT/c-cuda.txt
# 2c. measures what each device call costs (benchmarks/device_call_costs.py: the driver calls
#    of cudapool's CUDA backend, several sizes; the JSON replays price their calls with)
#                                                                        -> $OUT/device-call-costs.txt,
#                                                                           device-call-costs.json
# 3. runs the GPU tests: pytest -m gpu (capped at 240 s)                 -> $OUT/pytest-gpu.log,
#                                                                           $OUT/pytest-gpu.xml
# 4. runs the A/B benchmark, built-in allocator vs cudapool              -> $OUT/ab.txt, ab.json
# 5. checks the `builtin` replay policy against the real built-in allocator: records three
#    workloads' memory snapshots under it and replays them (benchmarks/builtin_fidelity.py)
#                                                                        -> $OUT/fidelity.txt,
#                                                                           fidelity.json
# 5b. records snapshots of the tracer's fidelity programs under the built-in allocator and
#    compares them with the tracer's traces (benchmarks/tracer_fidelity.py --gpu)
#                                                                        -> $OUT/tracer-fidelity.txt
# 5c. runs the lab's torch workloads (small) on the GPU untraced, records their snapshots and
#    compares them with their meta traces (benchmarks/tracer_lab_gpu.py)  -> $OUT/tracer-lab.txt,
#                                                                           lab-snapshots/
# 6. runs the C micro-benchmark when make is there                       -> $OUT/bench-micro.txt,
#                                                                           bench-micro.json
# 9. runs `python -m cudapool ab` on the lab's workloads, and `ab --simulate` beside it (predicted
#    peak reserved and max batch against the measured ones) (benchmarks/ab_suite.py: a GPT and a
#    CNN of benchmarks/ab_train.py under builtin, expandable and cudapool, with the step marker
#    and the max-batch search; capped at 120 s, the time left)       -> $OUT/ab-suite.txt,
#                                                                           ab-suite.tgz (JSON)
# The short stages that check what the default policy rests on come first, so that a run cut
# short by the budget still has them.
# then prints a summary. A failing stage does not stop the later ones. Exits non-zero when
# the build or the GPU tests fail; a benchmark failure shows in the summary only.
#
# Budget: 7 minutes on one H200. Every stage runs under a time cap, and the run as a whole
# under GPU_CHECK_BUDGET_S (default 420 s, so that a start and a rerun fit a 15-minute lease):
# a stage that would start with too little time left is skipped, and the summary says so;
# GPU_CHECK_BUDGET_S=540 runs the later benchmarks too.
#
# Settings (environment): OUT, PYTHON (default python3), GPU_CHECK_BUDGET_S,
# CUDAPOOL_WERROR (unset here by default: another compiler's new warnings must not cost the run).
set -euo pipefail

OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_INDEX=1 PIP_ROOT_USER_ACTION=ignore
# A distribution Python that refuses pip installs outside a virtual environment.
if "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")))' 2>/dev/null; then
  export PIP_BREAK_SYSTEM_PACKAGES=1
fi

section() {
  printf '\n== %s (t=%ds)\n' "$*" "$SECONDS"
}

# The seconds a stage may take: its cap, or what is left of the budget (less a margin for
# the stages' own clean-up and the summary). 0: not enough left to start it.
stage_time() {
  local cap=$1 left=$((BUDGET_S - SECONDS - 15))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  if [ "$cap" -lt 20 ]; then cap=0; fi
  echo "$cap"
}

# with_timeout SECONDS CMD...: run CMD, killed after SECONDS (exit 124 then).
with_timeout() {
  local seconds=$1
  shift
  if command -v timeout >/dev/null 2>&1; then
    timeout -k 10 "$seconds" "$@"
  else
    "$@"
  fi
}

# status_of RC SECONDS: a word for a stage's exit status.
status_of() {
  case "$1" in
    0) echo "ok" ;;
    124 | 137) echo "TIMED OUT (after ${2}s)" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}

# run_stage SECONDS OUTFILE CMD...: one stage under its time cap (0: not started), its output
# shown and kept in OUTFILE. Sets STAGE_RC and STAGE_STATUS: "SKIPPED (out of time)", "ok",
# "TIMED OUT ...", "FAILED ...", or "skipped (no CUDA GPU)" when the command said so.
run_stage() {
  local seconds=$1 file=$2
  shift 2
  STAGE_RC=0
  if [ "$seconds" -eq 0 ]; then
    STAGE_STATUS="SKIPPED (out of time)"
    STAGE_RC=-1
    return 0
  fi
  with_timeout "$seconds" "$@" 2>&1 | tee "$file" || STAGE_RC=$?
  STAGE_STATUS=$(status_of "$STAGE_RC" "$seconds")
  if [ "$STAGE_RC" -eq 0 ] && grep -q '^no CUDA GPU: skipped' "$file"; then STAGE_STATUS="skipped (no CUDA GPU)"; fi
}

build_status="not run"
info_line=""
tests_status="not run"
tests_line=""
ab_status="not run"
suite_status="not run"
fidelity_status="not run"
tracer_status="not run"
tracer_lab_status="not run"
micro_status="not run"
tests_rc=1

# -- 1. build ---------------------------------------------------------------------------------
section "build: $PYTHON -m pip install --no-build-isolation --no-deps -e ."
"$PYTHON" --version
t=$(stage_time 240)
build_rc=0
with_timeout "$t" "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || build_rc=$?
if [ "$build_rc" -ne 0 ]; then
  echo "pip install failed (exit $build_rc); trying an in-place build: setup.py build_ext --inplace"
  t=$(stage_time 180)
  if [ "$t" -gt 0 ] && with_timeout "$t" "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1; then
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
    build_rc=0
    build_how="setup.py build_ext --inplace (pip install failed)"
  fi
else
  build_how="pip install -e ."
fi
if [ "$build_rc" -eq 0 ] && ! "$PYTHON" -c 'import cudapool, cudapool._C' >>"$OUT/build.log" 2>&1; then
  echo "the build finished, but cudapool does not import" >>"$OUT/build.log"
  build_rc=1
fi
warnings=$(grep -c 'warning:' "$OUT/build.log" || true)
if [ "$build_rc" -eq 0 ]; then
  build_status="ok: $build_how, $warnings compiler warning(s)"
  echo "$build_status"
else
  build_status="FAILED (exit $build_rc)"
  echo "build failed; the end of $OUT/build.log:"
  tail -n 40 "$OUT/build.log"
fi

if [ "$build_rc" -eq 0 ]; then
  # -- 2. what cudapool sees --------------------------------------------------------------------
  section "info: $PYTHON -m cudapool info"
  {
    with_timeout 60 "$PYTHON" -m cudapool info || echo "(python -m cudapool info: exit $?)"
    echo
    with_timeout 60 "$PYTHON" -c '
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())
from cudapool import _torch, _torch_libraries
print("cudapool._torch_oom (out of memory as torch.OutOfMemoryError):", _torch_libraries.torch_oom_library_path() or "not built")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print("  cuda:%d %s, %.1f GiB, compute capability %d.%d" % (i, p.name, p.total_memory / 2**30, p.major, p.minor))
' || echo "(torch query: exit $?)"
    if command -v nvidia-smi >/dev/null 2>&1; then
      nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    else
      echo "nvidia-smi: not on PATH"
    fi
  } 2>&1 | tee "$OUT/info.txt"
  info_line=$(grep -m1 '^CUDA devices:' "$OUT/info.txt" || grep -m1 '^CUDA driver:' "$OUT/info.txt" || true)

# -- 2b. C tests of the CUDA backend on the GPU (the page-mapped calls of the default policy) ---
ccuda_status="skipped (no make)"
if command -v make >/dev/null 2>&1; then
  section "C tests of the CUDA backend: build/release/test_cuda_nodriver"
  t=$(stage_time 60)
  if [ "$t" -eq 0 ]; then
    ccuda_status="SKIPPED (out of time)"
  else
    ccuda_rc=0
    with_timeout "$t" sh -c 'make build/release/test_cuda_nodriver && ./build/release/test_cuda_nodriver' \
      >"$OUT/c-cuda.txt" 2>&1 || ccuda_rc=$?
    ccuda_status="$(status_of "$ccuda_rc" "$t")  $(grep -E 'passed, [0-9]+ failed' "$OUT/c-cuda.txt" | tail -n 1 || true)"
    tail -n 5 "$OUT/c-cuda.txt"
  fi
fi

# -- 2c. What each device call costs on this GPU (the lab's cost table) -----------------------
section "device call costs: $PYTHON benchmarks/device_call_costs.py --json $OUT/device-call-costs.json"
run_stage "$(stage_time 60)" "$OUT/device-call-costs.txt" \
  "$PYTHON" benchmarks/device_call_costs.py --json "$OUT/device-call-costs.json"
costs_status=$STAGE_STATUS
if [ "$costs_status" = "ok" ]; then
  costs_status="ok: $(grep -c '^| [a-z_]* |' "$OUT/device-call-costs.txt" || true) call kinds measured (us per call, us per GiB)"
fi


  # -- 3. GPU tests -----------------------------------------------------------------------------
  section "tests: $PYTHON -m pytest -m gpu -v tests/test_gpu.py tests/"
  t=$(stage_time 240)
  if [ "$t" -eq 0 ]; then
    tests_status="SKIPPED (out of time)"
  else
    tests_rc=0
    with_timeout "$t" "$PYTHON" -m pytest -m gpu -v -rs -p no:cacheprovider \
      --junitxml="$OUT/pytest-gpu.xml" tests/test_gpu.py tests/ 2>&1 | tee "$OUT/pytest-gpu.log" || tests_rc=$?
    tests_status=$(status_of "$tests_rc" "$t")
    if [ "$tests_rc" -eq 5 ]; then tests_status="FAILED (no GPU test was collected)"; fi
    tests_line=$(grep -E '^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* =+$' "$OUT/pytest-gpu.log" | tail -n 1 || true)
  fi

  # -- 4. A/B benchmark -------------------------------------------------------------------------
  section "A/B benchmark: $PYTHON benchmarks/ab_torch.py --json $OUT/ab.json"
  t=$(stage_time 150)
  run_stage "$t" "$OUT/ab.txt" "$PYTHON" benchmarks/ab_torch.py --json "$OUT/ab.json" --timeout $((t / 2))
  ab_status=$STAGE_STATUS

  # -- 5. fidelity of the builtin replay policy -------------------------------------------------
  # About a minute: three recorded runs (a third of the cap each at most), then CPU replays.
  section "builtin replay fidelity: $PYTHON benchmarks/builtin_fidelity.py --json $OUT/fidelity.json"
  t=$(stage_time 150)
  run_stage "$t" "$OUT/fidelity.txt" "$PYTHON" benchmarks/builtin_fidelity.py --json "$OUT/fidelity.json" \
    --timeout $((t / 3))
  fidelity_status=$STAGE_STATUS

  # -- 5b. the tracer against snapshots of the same programs ----------------------------------
  section "tracer fidelity: $PYTHON benchmarks/tracer_fidelity.py --gpu $OUT/tracer-snapshots"
  run_stage "$(stage_time 60)" "$OUT/tracer-fidelity.txt" "$PYTHON" benchmarks/tracer_fidelity.py \
    --gpu "$OUT/tracer-snapshots" --json "$OUT/tracer-fidelity.json"
  tracer_status=$STAGE_STATUS

  # -- 5c. the lab's workloads on the GPU against their traces --------------------------------
  section "tracer vs the lab on the GPU: $PYTHON benchmarks/tracer_lab_gpu.py --out $OUT/lab-snapshots"
  run_stage "$(stage_time 90)" "$OUT/tracer-lab.txt" "$PYTHON" benchmarks/tracer_lab_gpu.py \
    --out "$OUT/lab-snapshots" --json "$OUT/tracer-lab.json"
  tracer_lab_status=$STAGE_STATUS
fi

# -- 6. C micro-benchmark ---------------------------------------------------------------------
if command -v make >/dev/null 2>&1; then
  section "micro-benchmark: make bench-micro"
  t=$(stage_time 90)
  if [ "$t" -eq 0 ]; then
    micro_status="SKIPPED (out of time)"
  else
    micro_rc=0
    with_timeout "$t" make bench-micro >"$OUT/bench-micro.txt" 2>&1 || micro_rc=$?
    micro_status=$(status_of "$micro_rc" "$t")
    tail -n 20 "$OUT/bench-micro.txt"
    if [ -f build/bench-micro.json ]; then cp build/bench-micro.json "$OUT/bench-micro.json"; fi
  fi
else
  micro_status="skipped (no make)"
fi

# -- 9. python -m cudapool ab on the lab's workloads -------------------------------------------
if [ "$build_rc" -eq 0 ]; then
  section "ab suite: $PYTHON benchmarks/ab_suite.py"
  t=$(stage_time 180)
  run_stage "$t" "$OUT/ab-suite.txt" "$PYTHON" benchmarks/ab_suite.py --budget-s $((t > 10 ? t - 10 : 0)) \
    --json-dir "$OUT/ab-suite" --simulate
  suite_status=$STAGE_STATUS
  if [ -d "$OUT/ab-suite" ]; then
    (cd "$OUT" && tar czf ab-suite.tgz ab-suite && rm -rf ab-suite) || true
  fi
fi

# -- summary ----------------------------------------------------------------------------------
section "summary"
echo "build        : $build_status"
if [ -n "$info_line" ]; then echo "cuda         : $info_line"; fi
echo "gpu tests    : $tests_status${tests_line:+  $tests_line}"
if [ -f "$OUT/pytest-gpu.log" ]; then
  grep -E '^(FAILED|ERROR) ' "$OUT/pytest-gpu.log" | sed 's/^/               /' || true
fi
echo "a/b benchmark: $ab_status"
if [ -f "$OUT/ab.txt" ]; then grep '^|' "$OUT/ab.txt" | sed 's/^/               /' || true; fi
echo "ab suite     : $suite_status"
if [ -f "$OUT/ab-suite.txt" ]; then
  grep -E '^(== |builtin|expandable|cudapool|SKIPPED|TIMED OUT|FAILED)' "$OUT/ab-suite.txt" | sed 's/^/               /' || true
fi
echo "fidelity     : $fidelity_status"
echo "tracer       : $tracer_status"
echo "tracer (lab) : $tracer_lab_status"
if [ -f "$OUT/fidelity.txt" ]; then
  grep -E '^(\||largest |note: |FAILED: )' "$OUT/fidelity.txt" | sed 's/^/               /' || true
fi
echo "micro bench  : $micro_status"
echo "c cuda tests : $ccuda_status"
echo "call costs   : $costs_status"
if [ -f "$OUT/device-call-costs.txt" ]; then
  grep -E '^\| (reserve|release|event_record|page_create|page_map|page_set_access|page_unmap|page_release) \|' \
    "$OUT/device-call-costs.txt" | sed 's/^/               /' || true
fi
echo "time         : ${SECONDS}s of a ${BUDGET_S}s budget"

# The device tool brings back at most 8 files: the logs go into one archive, the figures stay.
(
  cd "$OUT"
  logs=$(ls -1 | grep -E '\.(log|txt|xml)$' || true)
  if [ -n "$logs" ]; then
    # shellcheck disable=SC2086
    tar czf logs.tgz $logs && rm -f $logs
  fi
)
echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"

if [ "$build_rc" -ne 0 ]; then exit 1; fi
if [ "$tests_rc" -ne 0 ]; then exit 1; fi
exit 0

#!/usr/bin/env bash
# Issue 54 (branch ranksdiffer) on ONE H200: the one-GPU tests of everything the branch touched.
# Ranks whose graphs differ (both ranks on the GPU, the real engines), the step path, the lockstep and
# background captures with their concurrency stress tests, the rank tests, the typed retry rule
# (CaptureInvalidatedError from the engines: an invalidated capture, a cold recording's retry).
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/ranksdiffer.sh   (<= 200 s in all)
# Writes under $OUT/ranksdiffer/: one log and one JUnit XML per group, summary.txt (printed at the end).
# Groups run in order of priority, each under the time left; a group that would start with less than
# its minimum is skipped and says so. pytest's exit code 5 ("no tests ran") is not a failure.
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/ranksdiffer"
mkdir -p "$DIR"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-195}
start=$(date +%s)
SUMMARY="$DIR/summary.txt"
: > "$SUMMARY"

left() { echo $(( BUDGET - ($(date +%s) - start) )); }

group() {  # name min_seconds pytest-args...
  local name=$1 need=$2 t0 rc last
  shift 2
  if [ "$(left)" -lt "$need" ]; then
    echo "$name: SKIPPED ($(left) s left, needs $need)" | tee -a "$SUMMARY"
    return
  fi
  t0=$(date +%s)
  timeout --kill-after=5 "$(left)" $PY -m pytest -q -p no:cacheprovider -m gpu -rfEs \
    --junitxml="$DIR/$name.xml" "$@" > "$DIR/$name.log" 2>&1
  rc=$?
  last=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$DIR/$name.log" | tail -1)
  case $rc in
    0|5) verdict=ok ;;
    124|137) verdict="TIMED OUT" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  echo "$name: $verdict in $(( $(date +%s) - t0 )) s: $last" | tee -a "$SUMMARY"
}

$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$SUMMARY"

# The new combinations first: both ranks on the GPU, the toy model's gloo all-reduce in every recording.
group differ 40 tests/manager/test_ranks_that_differ.py tests/manager/test_lockstep_capture.py \
  tests/manager/test_lockstep_ranks.py
# Data-parallel steps and capture faults with both ranks on the GPU (gloo and shm agreements).
group ranks 35 tests/manager/test_ranks.py
# The step path, the eager reasons, and the typed retry rule on real captures.
group step_path 15 tests/manager/test_step_path.py tests/manager/test_manager_recovery.py \
  tests/manager/test_idle_and_refused_steps.py
group background 30 tests/manager/test_background_capture.py tests/manager/test_capture_worker.py \
  tests/manager/test_first_step_first.py
group warm_ups 20 tests/manager/test_warm_up_classes.py tests/manager/test_warm_up_rule.py
group races 30 tests/manager/test_background_races.py
group capture 15 tests/capture/test_breakable.py tests/capture/test_record.py tests/capture/test_wrapper.py tests/capture/test_loop.py tests/test_bad_inputs.py

echo "total: $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
echo "logs and JUnit XML: $DIR (summary.txt)"

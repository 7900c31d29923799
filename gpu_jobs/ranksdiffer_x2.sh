#!/usr/bin/env bash
# Issue 54 (branch ranksdiffer) on TWO GPUs of one host: every 2-GPU test, and the new combinations of
# ranks whose graphs differ with the expert-parallel decoder (NCCL's all-to-alls inside the graphs;
# agreements over NCCL and gloo), each rank a process under a hard timeout (tests.ranks_support).
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/ranksdiffer_x2.sh   (<= 540 s in all; BUDGET=)
# Writes under $OUT/ranksdiffer_x2/: one log and one JUnit XML per group, summary.txt (printed).
# NVLink multicast stays off; every worker frees its graphs before its process ends (none tears the
# process group down: rank_main writes its result and leaves with os._exit).
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/ranksdiffer_x2"
mkdir -p "$DIR"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
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

$PY -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs:', torch.cuda.get_device_name(0))" \
  | tee -a "$SUMMARY"

# The new combinations over NCCL (and a gloo agreement), then the same on one GPU shared by both ranks.
group differ 90 tests/manager/test_ranks_that_differ.py
# Lockstep capture of the EP decoder (staggered starts), graphs missing on one rank, then the oracle cases.
group ep_lockstep 60 tests/manager/test_ep_moe.py -k "background or missing"
group ranks 90 tests/manager/test_ranks.py tests/manager/test_lockstep_ranks.py tests/manager/test_lockstep_capture.py
group ep_oracle 120 tests/manager/test_ep_moe.py -k "matches_the_oracle_on_two_gpus"

echo "total: $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
echo "logs and JUnit XML: $DIR (summary.txt)"

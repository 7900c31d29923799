#!/usr/bin/env bash
# Issue 40, item 5: estimate_memory()'s time over the capture's (target <= 0.10) and its error, per model,
# under three rules interleaved in one process (tests/benchmarks/estimate_ab.py): "old" (before this
# branch: 1 + max(2, ceil(0.08 * others)) probes a mode, every mode's smallest key warmed up), "new" (the
# package's: probe_count, 6% of a mode's keys rounded down, at least 3; FULL_AND_PIECEWISE's twin smallest
# keys warmed up once), "min4" (new with at least 4 probes a mode: the fallback if "new" loses accuracy).
# One H200, from the repository root, <= 90 s; everything under $OUT/estimate/. Then, with the time left,
# the estimate's GPU tests (error bound, nothing left behind).
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
D="$OUT/estimate"
mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
# Cases in order of importance (reference FULL_AND_PIECEWISE 512 first: the target's figure); none
# starts after 58 s, the whole A/B is cut at 72 s (a case cut off prints nothing; those before it stand).
timeout 72 python3 -m tests.benchmarks.estimate_ab --rules old,new,min4 --rounds 3 --deadline 58 \
  --json "$D/estimate_ab.jsonl" >"$D/estimate_ab.txt" 2>"$D/estimate_ab.err"
echo "estimate_ab rc=$? after ${SECONDS}s"
cat "$D/estimate_ab.txt"
tail -3 "$D/estimate_ab.err"
LEFT=$((86 - SECONDS))
if (( LEFT > 12 )); then
  timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider -m gpu tests/manager/test_estimate.py \
    >"$D/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$? after ${SECONDS}s: $(tail -1 "$D/gpu_tests.txt")"
else
  echo "gpu tests skipped: ${LEFT}s left (run tests/manager/test_estimate.py -m gpu in the GPU batch)"
fi

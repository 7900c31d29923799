#!/usr/bin/env bash
# Issue 40, item 5: estimate_memory()'s time over the capture's (target <= 0.10) and its error, the probe
# count before this branch ("old": 1 + max(2, ceil(0.08 * others)) per mode) against the package's
# ("new": probe_count, 6% of a mode's keys rounded down, at least 3), interleaved ABBA in one process per
# model list (tests/benchmarks/estimate_ab.py). One H200, from the repository root, <= 90 s; everything
# under $OUT/estimate/. Then, with the time left, the estimate's GPU tests (error bound, nothing left behind).
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
D="$OUT/estimate"
mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
# Cases in order of importance; none starts after 55 s, the whole A/B is cut at 68 s.
timeout 68 python3 -m tests.benchmarks.estimate_ab --rounds 3 --deadline 55 --json "$D/estimate_ab.jsonl" \
  >"$D/estimate_ab.txt" 2>"$D/estimate_ab.err"
echo "estimate_ab rc=$? after ${SECONDS}s"
cat "$D/estimate_ab.txt"
tail -3 "$D/estimate_ab.err"
LEFT=$((85 - SECONDS))
if (( LEFT > 8 )); then
  timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider -m gpu tests/manager/test_estimate.py \
    >"$D/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$? after ${SECONDS}s: $(tail -1 "$D/gpu_tests.txt")"
else
  echo "gpu tests skipped: ${LEFT}s left"
fi

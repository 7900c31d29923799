#!/usr/bin/env bash
# misuse (issue 51: the new APIs refuse bad arguments before any state changes), on one H200; <= 120 s.
# Run from the repo root. Everything it reports goes under "$OUT/misuse/".
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
mkdir -p "$OUT/misuse"
nvidia-smi -L > "$OUT/misuse/gpus.txt" 2>&1
SECONDS=0
summary() { grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | cut -c1-600; }
# 1. Every bad input's GPU rows: devices that do not exist (cuda:7), a builder or items on another
#    device than the manager's, a paged eager step's bad token id refused before the buffers change.
timeout 55 python3 -m pytest -p no:cacheprovider -v -m gpu --basetemp="$OUT/misuse/pt1" \
  tests/test_bad_inputs.py 2>&1 | tee "$OUT/misuse/bad_inputs.txt" | summary
echo "bad_inputs: rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee "$OUT/misuse/rc.txt"
# 2. The other misuse tests' GPU cases, with the time left: the paged checks on the device, the
#    loops, re-entrant calls, the manager's errors and devices, the encoder on a GPU.
left=$((115 - SECONDS))
timeout "$left" python3 -m pytest -p no:cacheprovider -v -m gpu --basetemp="$OUT/misuse/pt2" \
  tests/manager/test_manager_devices.py tests/manager/test_reentrant_calls.py \
  tests/manager/test_manager_errors.py tests/manager/test_loop_misuse.py \
  tests/manager/test_encoder_gpu.py tests/manager/test_paged_misuse.py \
  2>&1 | tee "$OUT/misuse/misuse_tests.txt" | summary
echo "misuse tests: rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/misuse/rc.txt"

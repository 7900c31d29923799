#!/usr/bin/env bash
# Round 1 on one H200: the new GPU code's first contact (reserved KV memory, the shrinking loop), the
# misuse and rank tests, then the benchmarks. At most ~560 s:
#   A. three pytest processes at once (correctness only; no free-memory reads)      <= 230 s
#   B. the tests that read the device's free memory, alone                           <= 90 s
#   C. benchmarks, serially, as time allows                                           the rest
set -u -o pipefail
OUT="${OUT:?set OUT}"
D="$OUT/r1"
mkdir -p "$D"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
export HYPOTHESIS_PROFILE=ci
export KVFIRST_RUNS="$D/kv_runs.jsonl" SHRINKLOOP_RUNS="$D/loop_runs.jsonl"
: > "$KVFIRST_RUNS"; : > "$SHRINKLOOP_RUNS"
PY=python3
start=$(date +%s)
BUDGET=${BUDGET:-555}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
say() { echo "[r1 $(( $(date +%s) - start ))s] $*" | tee -a "$D/log.txt"; }
say "$(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | head -1); torch $($PY -c 'import torch;print(torch.__version__)')"
T="--timeout=150 -p no:cacheprovider -q -rfE"

# A. correctness, three processes at once.
( timeout 225 $PY -m pytest $T -m gpu tests/capture/test_reserved_memory_gpu.py tests/manager/test_kv_first.py \
    -k "not larger_than_the_device and not more_than_is_free and not dies_mid_way and not margin_free" \
    > "$D/a_kv.log" 2>&1; echo "rc=$?" >> "$D/a_kv.log" ) &
( timeout 225 $PY -m pytest $T -m gpu tests/capture/test_shrinking_loop.py tests/capture/test_loop.py \
    tests/manager/test_shrinking_run_loop.py tests/manager/test_run_loop.py tests/manager/test_loop_misuse.py \
    tests/manager/test_decode_loop.py > "$D/a_loop.log" 2>&1; echo "rc=$?" >> "$D/a_loop.log" ) &
( timeout 225 $PY -m pytest $T -m gpu tests/test_bad_inputs.py tests/manager/test_ranks_that_differ.py \
    tests/manager/test_ranks.py tests/manager/test_lockstep_capture.py tests/manager/test_lockstep_ranks.py \
    tests/manager/test_step_path.py tests/manager/test_manager_recovery.py tests/manager/test_background_capture.py \
    tests/manager/test_capture_worker.py tests/manager/test_first_step_first.py tests/manager/test_background_races.py \
    tests/manager/test_warm_up_classes.py tests/manager/test_warm_up_rule.py tests/manager/test_capture_faults.py \
    tests/manager/test_release.py tests/manager/test_manager_devices.py tests/manager/test_reentrant_calls.py \
    tests/manager/test_manager_errors.py tests/manager/test_encoder_gpu.py tests/manager/test_paged_misuse.py \
    > "$D/a_rest.log" 2>&1; echo "rc=$?" >> "$D/a_rest.log" ) &
wait
for f in a_kv a_loop a_rest; do say "$f: $(grep -E '^rc=' $D/$f.log) $(grep -E 'passed|failed' $D/$f.log | tail -1 | cut -c1-150)"; done

# B. free-memory readers, alone.
timeout 95 $PY -m pytest $T -m gpu tests/capture/test_reserved_memory_gpu.py tests/manager/test_kv_first.py \
  tests/manager/test_estimate.py tests/manager/test_kv_sizing.py tests/manager/test_sleep_cycles.py \
  -k "larger_than_the_device or more_than_is_free or dies_mid_way or margin_free or estimate or sizing or sleep" \
  > "$D/b_mem.log" 2>&1
say "b_mem: rc=$? $(grep -E 'passed|failed' $D/b_mem.log | tail -1 | cut -c1-150)"

# C. benchmarks, as time allows: the KV resize and two start-up orders, the shrinking loop, issue 49's rows.
bench() {  # name, cap, pytest args...
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) < cap ? $(left) : cap ))
  if [ "$t" -lt 25 ]; then say "bench $name skipped ($(left) s left)"; return; fi
  timeout "$t" $PY -m pytest -p no:cacheprovider -q -rfE --benchmark-only "$@" > "$D/c_$name.log" 2>&1
  say "bench $name: rc=$? in $t s cap: $(tail -1 $D/c_$name.log | cut -c1-120)"
}
bench loop 110 tests/benchmarks/test_bench_shrinking_loop.py
bench kv 80 tests/benchmarks/test_bench_kv_first.py -k "resize or (reference and rows) or gather"
export CUDAGRAPH_BENCH_DEFAULTS_ROUNDS=1 CUDAGRAPH_BENCH_DEFAULTS_SERVE_ROUNDS=1 CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT=80
export CUDAGRAPH_BENCH_DEFAULTS_LOG="$D/defaults.jsonl"
export CUDAGRAPH_BENCH_DEFAULTS_ESTIMATE_CASES=reference-FP-512,wide-FP-512,paged_gather-FP-512
bench defaults 200 tests/benchmarks/test_bench_defaults.py -k "not reference"

# Summary, last.
say "=== summary"
for f in a_kv a_loop a_rest b_mem; do echo "--- $f"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" "$D/$f.log" | tail -25 | cut -c1-300; done
echo "--- kv runs"; cut -c1-400 "$KVFIRST_RUNS"
echo "--- loop runs"; cut -c1-400 "$SHRINKLOOP_RUNS"
echo "--- defaults"; [ -f "$D/defaults.jsonl" ] && cut -c1-600 "$D/defaults.jsonl"
say "total"

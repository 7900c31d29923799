#!/usr/bin/env bash
# Round 2 on one H200 (the card alone: free-memory readers run serially): the flex fault under a cache
# backed to the whole device, the round-1 failures after their fixes, the loop's and issue 49's figures.
set -u -o pipefail
OUT="${OUT:?set OUT}"
D="$OUT/r2"
mkdir -p "$D"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
export HYPOTHESIS_PROFILE=ci
export SHRINKLOOP_RUNS="$D/runs.jsonl" KVFIRST_RUNS="$D/runs.jsonl"
: > "$D/runs.jsonl"
PY=python3
start=$(date +%s)
BUDGET=${BUDGET:-400}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
say() { echo "[r2 $(( $(date +%s) - start ))s] $*" | tee -a "$D/log.txt"; }
T="-p no:cacheprovider -q -rfE --timeout=120"

# 1. The margin start-up per backend, each alone, launches blocking: which op faults, if one does.
for a in flex varlen gather; do
  CUDA_LAUNCH_BLOCKING=1 timeout 60 $PY -m pytest $T --tb=long -x -m gpu tests/manager/test_kv_first.py \
    -k "margin_free and $a" > "$D/diag_$a.log" 2>&1
  say "margin[$a] rc=$? $(tail -1 $D/diag_$a.log | cut -c1-100)"
done

# 2. Round 1's failures after their fixes, and what the fault took down with it (serially).
timeout 150 $PY -m pytest $T -m gpu tests/capture/test_reserved_memory_gpu.py tests/manager/test_estimate.py \
  tests/manager/test_kv_sizing.py tests/manager/test_sleep_cycles.py tests/manager/test_shrinking_run_loop.py \
  "tests/manager/test_kv_first.py::test_random_steps_over_a_cache_backed_after_the_capture_equal_eager" \
  "tests/manager/test_decode_loop.py::test_gpu_the_device_loop_gives_the_host_loops_tokens" \
  tests/test_bad_inputs.py -k "not margin_free and (kv or reserved or Reserved or estimate or sizing or sleep or shrink or loop or random_steps or gpu_the_device or KV or more_than or dies or larger or unbacked or wrapping or imports)" \
  > "$D/tests.log" 2>&1
say "reruns rc=$? $(tail -1 $D/tests.log | cut -c1-150)"

# 3. The loop's figures (the default now: no shrinking, stop checked every 4 steps).
timeout "$(( $(left) < 70 ? $(left) : 70 ))" $PY -m pytest -p no:cacheprovider -q --benchmark-only \
  tests/benchmarks/test_bench_shrinking_loop.py > "$D/bench_loop.log" 2>&1
say "loop bench rc=$?"

# 4. Issue 49's cold rows with the on-disk caches warm (a first process primes them, as a user's
#    second start finds them), then the wake.
export CUDAGRAPH_BENCH_DEFAULTS_ROUNDS=1 CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT=80
export CUDAGRAPH_BENCH_DEFAULTS_LOG="$D/runs.jsonl"
if [ "$(left)" -gt 60 ]; then
  timeout 60 $PY -m tests.benchmarks.defaults cold --backend flex --page-size 128 > /dev/null 2>> "$D/log.txt"
  say "primed flex rc=$?"
  timeout 30 $PY -m tests.benchmarks.defaults cold --backend varlen --page-size 16 > /dev/null 2>> "$D/log.txt"
  say "primed varlen rc=$?"
fi
if [ "$(left)" -gt 40 ]; then
  timeout "$(( $(left) - 5 ))" $PY -m pytest -p no:cacheprovider -q --benchmark-only \
    tests/benchmarks/test_bench_defaults.py -k "cold or wake" > "$D/bench_defaults.log" 2>&1
  say "defaults bench rc=$?"
fi

say "=== summary"
for a in flex varlen gather; do echo "--- diag $a"; grep -nE "^E |Error|error:|\.py:[0-9]+: in " "$D/diag_$a.log" | head -30 | cut -c1-220; done
echo "--- reruns"; grep -E "^(FAILED|ERROR)|passed|failed" "$D/tests.log" | tail -20 | cut -c1-250
echo "--- runs"; cat "$D/runs.jsonl" | cut -c1-1500
say "total"

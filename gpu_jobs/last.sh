#!/usr/bin/env bash
# After the last change to capture() (no worker warm-up inside it): the concurrency tests of the
# start-up paths, in parallel; then every free-memory reader the suite's part B did not finish, each
# file a pytest of its own (its summary survives a later cut), the card alone.
set -u -o pipefail
OUT="${OUT:?set OUT}"
D="$OUT/last"
mkdir -p "$D"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
PY=python3
start=$(date +%s)
say() { echo "[last $(( $(date +%s) - start ))s] $*" | tee -a "$D/log.txt"; }
T="-p no:cacheprovider -q -rfE --tb=short -m gpu"

timeout 120 $PY -m pytest $T -n 4 --dist loadfile --timeout=100 tests/manager/test_capture_worker.py \
  tests/manager/test_first_step_first.py tests/manager/test_background_races.py \
  tests/manager/test_background_capture.py tests/manager/test_warm_up_classes.py \
  tests/manager/test_capture_faults.py tests/manager/test_release.py > "$D/concurrency.log" 2>&1
say "concurrency rc=$? $(tail -1 $D/concurrency.log | cut -c1-150)"

one() {  # name, cap, pytest args...
  local name=$1 cap=$2; shift 2
  timeout "$cap" $PY -m pytest $T -s --timeout="$cap" "$@" > "$D/$name.log" 2>&1
  say "$name rc=$? $(tail -1 $D/$name.log | cut -c1-150)"
}
one kv_sizing 110 tests/manager/test_kv_sizing.py
one margin 80 tests/manager/test_kv_first.py -k "margin_free or flex_refuses"
one run_loop 40 tests/manager/test_run_loop.py
one sleep 45 tests/manager/test_sleep_cycles.py
one estimate 45 tests/manager/test_estimate.py
say "=== failures"
grep -hE "^(FAILED|ERROR)|^E  " "$D"/*.log | head -40 | cut -c1-300
grep -h "estimate_bytes" "$D/kv_sizing.log" | cut -c1-600
say "total"

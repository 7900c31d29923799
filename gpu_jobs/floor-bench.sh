#!/usr/bin/env bash
# Issue 40, items 1-3 (branch floor-bench): the interleaved per-break benchmark and the device loop's
# floor profile. One H200, system python3 (torch 2.11), no installs; <= 120 s in all (each part is
# capped, and never runs past the total).
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/floor-bench.sh
# Writes under $OUT/floor-bench/: summary.txt (read first), *.log, *.json, bench.md.
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/floor-bench"
mkdir -p "$DIR"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
TOTAL=117
start=$(date +%s)
note() { echo "[floor-bench $(( $(date +%s) - start ))s] $*" | tee -a "$DIR/summary.txt"; }
# part NAME CAP_SECONDS COMMAND...: runs COMMAND for at most CAP seconds and what is left of TOTAL.
part() {
  local name=$1 cap=$2; shift 2
  local left=$(( TOTAL - ( $(date +%s) - start ) ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 8 ]; then note "$name: SKIPPED (no time left)"; return; fi
  timeout "$cap" "$@" > "$DIR/$name.log" 2>&1
  note "$name: exit $? (cap ${cap}s; 124 = timed out)"
}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import importlib.util as u, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    '| peer breakable_cuda_graphs:', 'importable' if u.find_spec('breakable_cuda_graphs') else
    'NOT importable (per-break ours/peer will be missing)')"
  date -u +%F; } > "$DIR/machine.txt" 2>&1
note "machine: $(tr '\n' ' ' < "$DIR/machine.txt")"

BENCH=(-m pytest -p no:cacheprovider -q --benchmark-only)
# 1. Per-break cost and the host cost of one call, interleaved, with spreads (item 2).
part bench_capture 30 $PY "${BENCH[@]}" tests/benchmarks/test_bench_capture.py \
  -k "per_break_cost or host_overhead_of_one_call" --benchmark-json="$DIR/bench_capture.json"
# 2. The loop profile, synthetic bodies: what an iteration adds, variant by variant (item 3).
part loop_floor_synthetic 30 $PY -m tests.benchmarks.loop_floor --part synthetic --out "$DIR/synthetic"
# 3. The loop profile on the manager: run_loop's per-iteration and per-call cost over its floor.
part loop_floor_manager 45 $PY -m tests.benchmarks.loop_floor --part manager --out "$DIR/manager"
# 4. The loop benchmark with its spreads; then, if time is left, the interleaved capture time.
part bench_loop 20 $PY "${BENCH[@]}" tests/benchmarks/test_bench_loop.py --benchmark-json="$DIR/bench_loop.json"
part bench_capture_time 40 $PY "${BENCH[@]}" tests/benchmarks/test_bench_capture.py -k capture_time \
  --benchmark-json="$DIR/bench_capture_time.json"

for f in "$DIR"/bench_*.json; do [ -s "$f" ] || rm -f "$f"; done
ls "$DIR"/bench_*.json >/dev/null 2>&1 && $PY -m tests.benchmarks.report "$DIR"/bench_*.json "$DIR" \
  > "$DIR/report.log" 2>&1
for f in "$DIR"/loop_floor_*.log "$DIR"/bench_*.log; do
  echo "== $f"; grep -v "^ *$" "$f" | tail -25
done >> "$DIR/summary.txt"
note "done"

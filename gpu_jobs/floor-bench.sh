#!/usr/bin/env bash
# Issue 40, items 1-3 (branch floor-bench): the interleaved per-break benchmark and the device loop's
# floor profile. One H200, system python3 (torch 2.11), no installs; <= 120 s in all.
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/floor-bench.sh
# Writes under $OUT/floor-bench/: *.log (stdout+stderr of each part), *.json, bench.md.
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/floor-bench"
mkdir -p "$DIR"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
start=$(date +%s)
note() { echo "[floor-bench $(( $(date +%s) - start ))s] $*" | tee -a "$DIR/summary.txt"; }

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import breakable_cuda_graphs" 2>/dev/null && echo "peer: breakable_cuda_graphs importable" \
    || echo "peer: breakable_cuda_graphs NOT importable (per-break ours/peer will be missing)"
  date -u +%F; } > "$DIR/machine.txt" 2>&1
note "machine: $(tr '\n' ' ' < "$DIR/machine.txt")"

# 1. Per-break cost (and the host cost of one call), interleaved, with spreads (item 2).
timeout 30 $PY -m pytest -p no:cacheprovider -q tests/benchmarks/test_bench_capture.py --benchmark-only \
  -k "per_break_cost or host_overhead_of_one_call" --benchmark-json="$DIR/bench_capture.json" \
  > "$DIR/bench_capture.log" 2>&1
note "bench_capture (per break, host cost) exit $?"

# 2. The loop profile, synthetic part: what an iteration adds, variant by variant (item 3).
timeout 30 $PY -m tests.benchmarks.loop_floor --part synthetic --out "$DIR/synthetic" \
  > "$DIR/loop_floor_synthetic.log" 2>&1
note "loop_floor synthetic exit $?"

# 3. The loop benchmark (per-iteration cost, tokens/s) with its new spreads.
timeout 15 $PY -m pytest -p no:cacheprovider -q tests/benchmarks/test_bench_loop.py --benchmark-only \
  --benchmark-json="$DIR/bench_loop.json" > "$DIR/bench_loop.log" 2>&1
note "bench_loop exit $?"

# 4. The loop profile, manager part: run_loop's per-iteration and per-call cost over its floor.
left=$(( 118 - ( $(date +%s) - start ) ))
[ "$left" -gt 10 ] && timeout "$left" $PY -m tests.benchmarks.loop_floor --part manager --out "$DIR/manager" \
  > "$DIR/loop_floor_manager.log" 2>&1
note "loop_floor manager exit $? (had ${left}s)"

ls "$DIR"/bench_*.json >/dev/null 2>&1 && $PY -m tests.benchmarks.report "$DIR"/bench_*.json "$DIR" \
  > "$DIR/report.log" 2>&1
for f in "$DIR"/loop_floor_*.log; do echo "== $f"; grep -v "^ *$" "$f" | tail -30; done >> "$DIR/summary.txt"
note "done"

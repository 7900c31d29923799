#!/usr/bin/env bash
# Issue 40 item 3 (branch loopfloor): where run_loop's per-iteration cost over its floor goes, and
# whether a WHILE body's memcpy nodes rewritten as loop_copy kernels (CopyRewrite, now the default)
# close it. One H200, system python3 (torch 2.11), no installs; <= 90 s in all.
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/loopfloor.sh
# Writes under $OUT/loopfloor/: loop_floor_ab.json, loop_floor_ab.log; prints the summary (<= 40 lines).
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/loopfloor"
mkdir -p "$DIR"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
start=$(date +%s)

# One process, every variant interleaved round by round: the floor graph replayed; that graph in a
# WHILE node with its memcpy nodes / with them as kernels; run_loop of a manager captured with the
# rewrite off / on. Batches 64, 8, 1 (64 first: the largest gap); the profile last, if time is left.
timeout 78 $PY -m tests.benchmarks.loop_floor_ab --out "$DIR" --batches 64 8 1 --rounds 7 --profile \
  > "$DIR/loop_floor_ab.log" 2>&1
rc=$?
echo "[loopfloor] loop_floor_ab exit $rc after $(( $(date +%s) - start ))s (124: timed out at 78 s; the JSON holds the batches done)"
if [ "$rc" -eq 0 ]; then
  sed -n '/^loop floor A\/B/,$p' "$DIR/loop_floor_ab.log" | cut -c1-400 | head -36
else
  grep -E "Error|error" "$DIR/loop_floor_ab.log" | tail -3 | cut -c1-300
  [ -f "$DIR/loop_floor_ab.json" ] && timeout 10 $PY -c "
import json, sys
from tests.benchmarks.loop_floor_ab import summary
print(summary(json.load(open(sys.argv[1]))))" "$DIR/loop_floor_ab.json" | cut -c1-400 | head -34
fi

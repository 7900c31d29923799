#!/usr/bin/env bash
# Issue 40 item 6 (branch coldvarlen): cold capture of the paged decoder against its record +
# instantiate floor, capture()'s warm-ups per key (before: ManagerOptions(warm_ups="every_key"))
# against per class (the new default "auto": per class while dynamo compiled nothing).
# One H200, system python3 (torch 2.11), no installs; <= 90 s in all (85 s of runs).
# Run from the repo root:  OUT=/some/dir bash gpu_jobs/coldvarlen.sh
# Writes under $OUT/coldvarlen/: runs.jsonl (one JSON line per cold process), *.log; prints a summary.
# Each run is its own process (a cold capture is a process's first): varlen old/new interleaved
# twice, varlen per_class, then flex auto (= every_key where flex compiled) and per_class, then the
# GPU tests if time is left (each step skipped when too little of the 85 s is left).
set -u
OUT="${OUT:?set OUT}"
DIR="$OUT/coldvarlen"
mkdir -p "$DIR"
: > "$DIR/runs.jsonl"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
start=$(date +%s)
BUDGET=85

left() { echo $(( BUDGET - ($(date +%s) - start) )); }

run() {  # backend policy min_seconds
  local backend=$1 policy=$2 need=$3 t0 rc
  if [ "$(left)" -lt "$need" ]; then
    echo "[coldvarlen] skipped $backend $policy: $(left) s left"
    return
  fi
  t0=$(date +%s)
  timeout "$(left)" $PY -m tests.benchmarks.floor_wake_profile cold --backend "$backend" --plain \
    --warm-ups "$policy" > "$DIR/$backend-$policy-$t0.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    tail -1 "$DIR/$backend-$policy-$t0.log" >> "$DIR/runs.jsonl"
  else
    echo "[coldvarlen] $backend $policy exit $rc: $(grep -E 'Error' "$DIR/$backend-$policy-$t0.log" | tail -1 | cut -c1-200)"
  fi
  echo "[coldvarlen] $backend $policy: $(( $(date +%s) - t0 )) s"
}

run varlen every_key 12
run varlen auto 12
run varlen every_key 12
run varlen auto 12
run varlen per_class 12  # the same as auto where nothing compiled ("keys warmed" tells)
run flex auto 20
run flex per_class 20

timeout 10 $PY - "$DIR/runs.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"cold capture / floor (record + instantiate of a capture without warm-ups), {len(rows)} runs"
      + (f", {rows[0]['device']}, torch {rows[0]['torch']}" if rows else ""))
print("backend policy | keys warmed/graphs | cold s | warm-ups s | floor s | cold/floor | no-warm-up s | dynamo compiles before")
groups = {}
for r in rows:
    groups.setdefault((r["backend"], r["warm_ups"]), []).append(r)
    print(f"{r['backend']} {r['warm_ups']} | {r['keys_warmed_up']}/{r['graphs']} | {r['cold_capture_s']} | "
          f"{r['cold_warm_up_s']} | {r['floor_record_instantiate_s']} | {r['cold_over_floor']} | "
          f"{r['no_warm_up_capture_s']} | {r['dynamo_compiles_before_capture']}")
med = {k: statistics.median(x["cold_over_floor"] for x in v) for k, v in groups.items()}
for (backend, policy), ratio in sorted(med.items()):
    print(f"MEDIAN {backend} {policy}: cold/floor {ratio:.3f} over {len(groups[(backend, policy)])} runs")
old, new = med.get(("varlen", "every_key")), med.get(("varlen", "auto"))
if old and new:
    print(f"VARLEN default (auto) {new:.3f} vs every_key {old:.3f}: target <= 2 -> {'MET' if new <= 2 else 'NOT MET'}")
flex = med.get(("flex", "auto"))
if flex:
    print(f"FLEX default (auto) {flex:.3f}: target <= 4 -> {'MET' if flex <= 4 else 'NOT MET'}")
EOF

if [ "$(left)" -ge 25 ]; then
  timeout "$(left)" $PY -m pytest -q -p no:cacheprovider -x tests/manager/test_warm_up_classes.py \
    > "$DIR/pytest.log" 2>&1
  echo "[coldvarlen] GPU tests (tests/manager/test_warm_up_classes.py) exit $?: $(tail -1 "$DIR/pytest.log" | cut -c1-200)"
else
  echo "[coldvarlen] GPU tests skipped: $(left) s left (run tests/manager/test_warm_up_classes.py)"
fi
echo "[coldvarlen] total $(( $(date +%s) - start )) s"

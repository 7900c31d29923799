#!/usr/bin/env bash
# Issue 53 (branch shrinkloop): the decode loop that shrinks as its requests finish (SWITCH or IF nodes
# chosen on the device, the rows partitioned on the device), and issue 49 item 6: the loop checks stop
# every LoopPolicy.check_every steps (default 4). One H200, python3 (torch 2.11, cuda-bindings 13.3),
# no installs; run from the repo root:  OUT=/some/dir bash gpu_jobs/shrinkloop.sh
# Writes under $OUT/shrinkloop/: pytest_*.log, bench.log, bench.json (pytest-benchmark), runs.jsonl
# (one JSON line per benchmark, written as each ends); prints a compact summary last. Within 300 s:
#   1. the loop engine's GPU tests (about 40 s): the kernels (k-step WHILE, SWITCH and IF choices,
#      the partition, the restore) against host loops bit for bit, SwitchReplay against the host's.
#   2. the manager's loop GPU tests (about 120 s): the new shrinking run_loop (a countdown toy, the
#      paged decoder on random stop schedules, four backends, fp32 and bf16) and the existing ones
#      (test_decode_loop, test_run_loop, test_loop_misuse), then the bad inputs of loops.
#   3. the benchmarks with the time left (about 110 s; cut at the budget, what ended is in
#      runs.jsonl): 256 requests stopping uniformly over 64 steps, none stopping, the SWITCH launch,
#      run_loop over its floor at 1, 8, 64 requests.
set -u
set -o pipefail
OUT="${OUT:?set OUT}"
DIR="$OUT/shrinkloop"
mkdir -p "$DIR"
: > "$DIR/runs.jsonl"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
export SHRINKLOOP_RUNS="$DIR/runs.jsonl"
export HYPOTHESIS_PROFILE=ci
PY=${PYTHON:-python3}
# A test that hangs (a loop that never stops) fails alone where pytest-timeout is installed.
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")
start=$(date +%s)
BUDGET=288  # seconds of work; the summary takes the rest of 300
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
step() { echo "[shrinkloop] $(( $(date +%s) - start )) s: $*"; }
run_tests() {  # name, limit in seconds, pytest arguments...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $PY -m pytest -q -p no:cacheprovider -rfE -m gpu $PER_TEST "$@" > "$DIR/pytest_$name.log" 2>&1
  local rc=$?
  step "$name: exit $rc: $(tail -1 "$DIR/pytest_$name.log" | cut -c1-150)"
  echo "$rc" > "$DIR/pytest_$name.rc"
}

# 1. The loop engine: the kernels first.
run_tests capture 60 tests/capture/test_shrinking_loop.py tests/capture/test_loop.py

# 2. The manager's loops: the new tests, then the existing ones (the benchmarks keep 110 s); the bad
#    inputs of loops.
run_tests manager "$(( $(left) - 140 > 170 ? 170 : $(left) - 140 ))" \
  tests/manager/test_shrinking_run_loop.py tests/manager/test_run_loop.py \
  tests/manager/test_loop_misuse.py tests/manager/test_decode_loop.py
timeout 30 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_bad_inputs.py \
  -k "loop or switch or shrink or check_every or request_rows" > "$DIR/pytest_bad_inputs.log" 2>&1
echo $? > "$DIR/pytest_bad_inputs.rc"
step "bad inputs: $(tail -1 "$DIR/pytest_bad_inputs.log" | cut -c1-150)"

# 3. Benchmarks, as time allows (each test's figures land in runs.jsonl when it ends).
if [ "$(left)" -ge 40 ]; then
  step "benchmarks: $(left) s left"
  timeout "$(( $(left) - 2 ))" $PY -m pytest -q -p no:cacheprovider -rfE --benchmark-only \
    --benchmark-json "$DIR/bench.json" tests/benchmarks/test_bench_shrinking_loop.py > "$DIR/bench.log" 2>&1
  step "benchmarks exit $? (124: cut at the budget): $(tail -1 "$DIR/bench.log" | cut -c1-150)"
else
  step "benchmarks skipped: $(left) s left"
fi

# 4. The summary: the tests, then each figure beside its target.
timeout 10 $PY - "$DIR" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("=" * 100)
for name in ("capture", "manager", "bad_inputs"):
    rc_file = out / f"pytest_{name}.rc"
    rc = rc_file.read_text().strip() if rc_file.exists() else "?"
    log = out / f"pytest_{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    failed = [l for l in lines if l.startswith(("FAILED", "ERROR"))]
    print(f"tests {name}: {'PASSED' if rc == '0' else 'exit ' + rc}: {(lines or ['no log'])[-1][:120]}")
    for line in failed[:8]:
        print("   ", line[:160])
runs = {}
for line in (out / "runs.jsonl").read_text().splitlines():
    if line.strip():
        row = json.loads(line)
        runs[row["test"]] = row
def ratio(row, key):
    value, target = row.get(key), row.get(f"{key}_target")
    spread = row.get(f"{key}_spread", "")
    if value is None:
        return f"{key}: -"
    verdict = "" if target is None else (" ok" if value <= target else " MISSED")
    return f"{key} {value:.3f}" + ("" if target is None else f" (target <= {target}){verdict}") + f" [{spread}]"
row = runs.get("uniform_stops")
if row:
    print(f"uniform stops (256 -> 0 over 64 steps; the loop: {row.get('choice')}, nested {row.get('nested')}, "
          f"keys {row.get('loop_sizes')}):", ratio(row, "shrinking_over_today"))
    print("   ", ratio(row, "shrinking_over_ideal_host"), "|", ratio(row, "fixed_over_today"))
    print(f"    ms per call: shrinking {row['shrinking_us'] / 1e3:.2f}, today {row['today_us'] / 1e3:.2f}, "
          f"fixed {row['fixed_us'] / 1e3:.2f}, ideal host {row['ideal_host_us'] / 1e3:.2f}")
    print(f"    steps by key: shrinking {row.get('shrinking_steps_by_key')}, ideal {row.get('ideal_steps_by_key')}")
    print(f"    tokens differing from today's (of {row.get('tokens')}): "
          + ", ".join(f"{k.split('_tokens')[0]} {v}" for k, v in row.items() if k.endswith("_differing_from_today"))
          + f"; ideal vs shrinking {row.get('ideal_host_tokens_differing_from_shrinking')}")
row = runs.get("nothing_stops")
if row:
    print("nothing stops:", ratio(row, "nothing_stops_shrinking_over_today"), "|",
          ratio(row, "nothing_stops_fixed_over_today"))
    print("   ", ratio(row, "nothing_stops_shrinking_over_ideal_host"))
row = runs.get("switch_launch")
if row:
    value, target = row["switch_added_us"], row["switch_added_us_target"]
    print(f"SWITCH launch ({row.get('choice')}): +{value:.2f} us over the host-chosen replay (median over "
          f"live counts; target <= {target}) {'ok' if value <= target else 'MISSED'}; max +{row['switch_added_us_max']:.2f}")
    print(f"    by live count: {row.get('switch_added_us_by_live')}")
for n in (1, 8, 64):
    row = runs.get(f"loop_floor_{n}")
    if row:
        others = ", ".join(f"{k[:-11]} {v:.3f}" for k, v in row.items() if k.endswith("_over_floor") and k != "default_over_floor")
        print(f"floor, {n:>2} requests (check_every={row.get('default_check_every')}):",
              ratio(row, "default_over_floor"), f"| {others}; floor {row.get('floor_us', 0):.1f} us/step")
missing = [t for t in ("uniform_stops", "nothing_stops", "switch_launch", "loop_floor_1", "loop_floor_8", "loop_floor_64") if t not in runs]
if missing:
    print("benchmarks not run (time, or an error: bench.log):", ", ".join(missing))
PYEOF
step "done"

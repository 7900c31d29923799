#!/usr/bin/env bash
# Issue 48 (branch kvfirst): capture first, then size the KV cache. One H200, python3 (torch 2.11,
# cuda-bindings 13.3), no installs; run from the repo root:  OUT=/some/dir bash gpu_jobs/kvfirst.sh
# Writes under $OUT/kvfirst/: *.log (pytest and each step), runs.jsonl (one JSON line per benchmark
# run), bench.json (pytest-benchmark); prints a compact summary last. Finishes within 330 s:
#   1. GPU tests (about 150 s): ReservedMemory under graphs (bit-exact replays after back, grow, drop
#      and re-back; a child that dies mid-way; out of memory), the 1,000 random steps per backend
#      (rows, flex, gather, varlen, split_decode; FULL and FULL_AND_PIECEWISE; foreground and
#      background capture; one step in ten with a block table or row past the backed units) each
#      against eager, grow/shrink/sleep/wake without recapture, the margin after start-up, the
#      README block, the bad inputs that need a GPU.
#   2. Benchmarks in fresh processes, as time allows (about 170 s; cut at the budget, the runs done
#      kept): grow 10 GiB and a wake re-backing 10 GiB; then capture first vs estimate first on the
#      five configurations (reference rows, gather, varlen, flex; the 8B-like shape last).
#   KVFIRST_PART=tests or KVFIRST_PART=bench runs one part only (default: both, in that order), so a
#   second run can give the benchmarks the whole budget if the first cut them short.
set -u
set -o pipefail
OUT="${OUT:?set OUT}"
PART="${KVFIRST_PART:-all}"
DIR="$OUT/kvfirst"
mkdir -p "$DIR"
: > "$DIR/runs.jsonl"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
export KVFIRST_RUNS="$DIR/runs.jsonl"
export HYPOTHESIS_PROFILE=ci
PY=${PYTHON:-python3}
start=$(date +%s)
BUDGET=318  # seconds of work; the summary takes the rest of 330
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
step() { echo "[kvfirst] $(( $(date +%s) - start )) s: $*"; }

# 1. The GPU tests: correctness first.
TESTS="tests/capture/test_reserved_memory_gpu.py tests/manager/test_kv_first.py"
TESTS="$TESTS tests/capture/test_reserved_memory.py tests/manager/test_kv_memory.py tests/manager/test_kv_first_models.py"
tests_rc=-1
bad_rc=-1
if [ "$PART" != "bench" ]; then
  step "GPU tests: $TESTS and test_bad_inputs -k 'kv or reserved'"
  timeout 200 $PY -m pytest -q -p no:cacheprovider -rfE --timeout 180 $TESTS \
    > "$DIR/pytest.log" 2>&1
  tests_rc=$?
  timeout 30 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_bad_inputs.py -k "kv or reserved" \
    > "$DIR/pytest_bad_inputs.log" 2>&1
  bad_rc=$?
  step "GPU tests exit $tests_rc ($(tail -1 "$DIR/pytest.log" | cut -c1-160)); bad inputs exit $bad_rc"
fi

# 2. Benchmarks, each run a fresh process, in one pytest while time is left (a run cut short by the
#    budget loses only itself: each finished run is in runs.jsonl). Order: resize, then the five
#    configurations in both orders, the 8B-like shape last.
if [ "$PART" = "tests" ]; then
  step "benchmarks not run (KVFIRST_PART=tests)"
elif [ "$(left)" -ge 30 ]; then
  step "benchmarks: $(left) s left"
  timeout "$(( $(left) - 2 ))" $PY -m pytest -q -p no:cacheprovider -rfE --benchmark-enable \
    --benchmark-json "$DIR/bench.json" tests/benchmarks/test_bench_kv_first.py > "$DIR/bench.log" 2>&1
  bench_rc=$?
  step "benchmarks exit $bench_rc (124: cut at the budget): $(tail -1 "$DIR/bench.log" | cut -c1-160)"
else
  step "benchmarks skipped: $(left) s left"
fi

# 3. The summary: the targets, from the runs' JSON lines.
timeout 10 $PY - "$DIR/runs.jsonl" "$tests_rc" "$bad_rc" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
tests_rc, bad_rc = int(sys.argv[2]), int(sys.argv[3])
MIB = 2**20
print("=" * 100)
def verdict(rc):
    return "not run" if rc == -1 else "PASSED" if rc == 0 else f"FAILED (exit {rc}; 124: cut at 200 s)"
print(f"GPU tests: {verdict(tests_rc)}; bad inputs: {verdict(bad_rc)} (logs: pytest*.log)")
print("config              order     KV GiB    units  free-margin MiB  capture s  start-up s  extra")
starts = {}
for r in rows:
    if r.get("order") not in ("capture", "estimate"):
        continue
    over = (r["left_bytes"] - r["margin_bytes"]) / MIB
    extra = (f"back {r['back_s'] * 1e3:.1f} ms" if r["order"] == "capture"
             else f"estimate {r['estimate_s']:.2f} s, error {(r['estimate_bytes'] - r['device_bytes']) / MIB:+.0f} MiB")
    config = f"{r['model']}/{r['attention']}"
    starts[(config, r["order"])] = r
    print(f"{config:<19} {r['order']:<9} {r['kv_bytes'] / 2**30:7.2f} {r['kv_units']:>8} {over:16.1f} "
          f"{r['capture_s']:10.2f} {r['startup_s']:11.2f}  {extra}")
for (config, order), r in sorted(starts.items()):
    if order != "capture":
        continue
    over = (r["left_bytes"] - r["margin_bytes"]) / MIB
    cost_ms = (r["startup_s"] - r["capture_s"]) * 1e3
    other = starts.get((config, "estimate"))
    gained = "" if other is None else f"; KV cache {(r['kv_bytes'] - other['kv_bytes']) / 2**30:+.2f} GiB vs estimate first"
    print(f"TARGET {config}: free - margin {over:+.1f} MiB (within 2 MiB: {'MET' if abs(over) < 2 else 'NOT MET'}); "
          f"start-up - capture {cost_ms:.1f} ms (<= 50: {'MET' if cost_ms <= 50 else 'NOT MET'}){gained}")
for r in rows:
    if r.get("order") == "resize":
        print(f"TARGET grow {r['gib']:g} GiB: {r['grow_ms']:.2f} ms, next step {r['grow_step_ms']:.2f} ms "
              f"(<= 20 ms: {'MET' if r['grow_ms'] <= 20 else 'NOT MET'}); wake re-backing {r['gib']:g} GiB: "
              f"{r['wake_ms']:.2f} ms, next step {r['wake_step_ms']:.2f} ms (<= 20 ms: "
              f"{'MET' if r['wake_ms'] <= 20 else 'NOT MET'}); drop {r['drop_ms']:.2f} ms; "
              f"medians of {r['rounds']} rounds, chunk {r['chunk_bytes'] // MIB} MiB")
if not rows:
    print("no benchmark ran (see bench.log)")
PYEOF
step "done"

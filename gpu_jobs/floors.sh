#!/usr/bin/env bash
# Issue 49 (branch floors): start-up, wake and background capture at their floors, for the defaults a
# user gets. One H200, system python3 (torch 2.11), no installs, from the repository root:
#     OUT=/some/dir bash gpu_jobs/floors.sh
# At most 410 s in all; each part has a time cap and is skipped when too little time is left.
#   0. an untimed first process, kept as a diagnostic: cold flex on a machine whose inductor and
#      Triton caches are empty (the rows after it find them warm, as a user's second start does;
#      the old variant's own compiles still find them empty)                                  <= 45 s
#   1. the rows, as `make bench` measures them (tests/benchmarks/test_bench_defaults.py, fresh
#      processes, the variants alternating): cold flex, new then old (2 processes, ~25 s); cold
#      varlen, auto then every_key (2, ~20 s); start_capture() against capture() on the small
#      decoder, 2 rounds ABBA (4, ~35 s); the wake, new and old (2, ~25 s); the estimate, six models,
#      both rules AB (1, ~60 s). Each row's figures are appended to figures.jsonl as measured; then
#      report.py's Targets table                                                              <= 175 s
#   2. the GPU tests of the start-up paths, serially (free memory is read: the card alone)    <= 185 s
#   3. with the time left: cold varlen under cProfile (cold minus warm recapture, per function),
#      and with CUDA_MODULE_LOADING=EAGER                                                     <= 40 s
#   4. the compact table, last.
# Files under $OUT/floors/ (8 at most): figures.jsonl, bench.json, bench.md, diag.jsonl, tests.txt,
# log.txt, summary.txt.
set -u -o pipefail
OUT="${OUT:?set OUT}"
D="$OUT/floors"
mkdir -p "$D"
: > "$D/diag.jsonl"
: > "$D/tests.txt"
: > "$D/figures.jsonl"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.${PYTHONPATH:+:$PYTHONPATH}
export CUDAGRAPH_BENCH_DEFAULTS_ROUNDS=1 CUDAGRAPH_BENCH_DEFAULTS_SERVE_ROUNDS=2
export CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT=90 CUDAGRAPH_BENCH_DEFAULTS_LOG="$D/figures.jsonl"
# The estimate's six models (make bench adds the 8B-like plan of 2,048 sizes beside them).
export CUDAGRAPH_BENCH_DEFAULTS_ESTIMATE_CASES=reference-FP-512,reference-FULL-512,wide-FP-512,reference-PW-2048,paged_gather-FP-512,paged_flex-FP-512
PY=${PYTHON:-python3}
LOG="$D/log.txt"
start=$(date +%s)
BUDGET=410
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
cap() { local want=$1 l; l=$(( $(left) - ${2:-0} )); echo $(( l < want ? l : want )); }
say() { echo "[floors $(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
# pytest-timeout, where installed: a test that runs long fails, and its session still writes its report.
timeout_flag() { $PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$1"; }

say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); $($PY -c 'import torch; print(torch.__version__)')"

diag() {  # label, cap, reserve, env and command...
  local label=$1 t; t=$(cap "$2" "$3"); shift 3
  if [ "$t" -lt 15 ]; then say "diag $label skipped: $(left) s left"; return; fi
  timeout "$t" env "$@" > "$D/diag.part" 2>> "$LOG"
  local rc=$?
  if [ $rc -eq 0 ]; then tail -1 "$D/diag.part" | sed "s/^{/{\"label\": \"$label\", /" >> "$D/diag.jsonl"; fi
  say "diag $label rc=$rc"
}

# 0. The first process (empty on-disk caches), kept as a diagnostic.
diag flex-first-process 45 330 $PY -m tests.benchmarks.defaults cold --backend flex --page-size 128

# 1. The rows (make bench's module), leaving >= 185 s for the tests and the table.
T=$(cap 175 185)
if [ "$T" -gt 60 ]; then
  timeout "$T" $PY -m pytest -p no:cacheprovider -q tests/benchmarks/test_bench_defaults.py --benchmark-only \
    -k "not reference" $(timeout_flag 110) --benchmark-json="$D/bench.json" >> "$LOG" 2>&1
  say "bench rc=$? ($T s cap)"
  timeout 30 $PY -m tests.benchmarks.report "$D/bench.json" "$D" >> "$LOG" 2>&1
  say "report rc=$?"
else
  say "bench skipped: $(left) s left"
fi

# 2. The GPU tests of the start-up paths: the issue's four first, then the rest; serially.
run_tests() {  # cap, files...
  local t=$1; shift
  if [ "$(left)" -lt 25 ]; then say "tests skipped: $(left) s left: $*"; echo "SKIPPED (time): $*" >> "$D/tests.txt"; return; fi
  t=$(cap "$t" 12)
  timeout "$t" $PY -m pytest -p no:cacheprovider -q -m gpu -rfE $(timeout_flag 100) "$@" > "$D/tests.part" 2>&1
  local rc=$?
  { echo "== rc=$rc: $*"; grep -E "^(FAILED|ERROR)|passed|failed|error|skipped|no tests ran" "$D/tests.part" | tail -12; } >> "$D/tests.txt"
  cat "$D/tests.part" >> "$LOG"
  say "tests rc=$rc: $* ($(tail -1 "$D/tests.part" | cut -c1-120))"
}
run_tests 70 tests/manager/test_background_races.py tests/manager/test_first_step_first.py \
  tests/manager/test_capture_faults.py tests/manager/test_sleep_cycles.py
run_tests 60 tests/manager/test_warm_up_classes.py tests/manager/test_warm_up_rule.py \
  tests/manager/test_estimate.py tests/manager/test_release.py
run_tests 55 tests/manager/test_capture_worker.py tests/manager/test_background_capture.py \
  tests/manager/test_kv_sizing.py
rm -f "$D/tests.part"

# 3. With the time left: where cold varlen recordings lose their time; is it lazy module loading?
diag varlen-profile 20 8 $PY -m tests.benchmarks.defaults cold --backend varlen --page-size 16 --profile
diag varlen-eager-loading 20 8 CUDA_MODULE_LOADING=EAGER $PY -m tests.benchmarks.defaults cold \
  --backend varlen --page-size 16
rm -f "$D/diag.part"

# 4. The compact table, last.
timeout 20 $PY - "$D" > "$D/summary.txt" 2>> "$LOG" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
def show(title, rows):
    print(f"\n{title}")
    for row in rows:
        print("  " + row)
figures = [json.loads(line) for line in (d / "figures.jsonl").read_text().splitlines() if line.strip()]
show("TARGETS (tests/benchmarks/test_bench_defaults.py, as make bench runs it)", [
    f"{x.get('label', x['name'])}: {x['figure']:.3f} ({x.get('figure_spread', '')}) target {x['target']}: "
    f"{'MET' if x.get('target_met') else 'NOT MET'}" for x in figures if "target" in x] or ["(none measured)"])
for x in figures:
    keep = {k: v for k, v in x.items() if k not in ("label", "figure", "figure_spread", "target", "target_met", "per_case")}
    show(f"{x.get('label', x['name'])}: details", [json.dumps(keep, default=str)[:1000]])
    if "per_case" in x:
        show("  estimate per case: (predicted ratio, predicted errors MiB, old rule's errors MiB)", [x["per_case"][:1500]])
for line in (d / "diag.jsonl").read_text().splitlines():
    r = json.loads(line)
    show(f"DIAG {r['label']}: cold/floor {r['cold_over_floor']} (cold {r['cold_s']} s = {r['cold_phases']}; floor "
         f"{r['floor_s']} s; keys warmed {r['keys_warmed_up']} {r['warmed_tokens']}; compiles {r['compiles_in_capture']}, "
         f"in recordings {r['compiles_in_recordings']}; first use in recordings {r['first_use_in_recordings_ms']} ms)",
         [json.dumps(k) for k in r["slowest_first_uses"][:5]] + [json.dumps(p) for p in r.get("cold_minus_warm_host_ms", [])[:12]])
show("TESTS", (d / "tests.txt").read_text().splitlines())
EOF
say "summary rc=$?"
cat "$D/summary.txt"
if [ -f "$D/bench.md" ]; then sed -n '/^## Targets/,/^## [^T]/p' "$D/bench.md" | head -12; fi
say "total $(( $(date +%s) - start )) s"

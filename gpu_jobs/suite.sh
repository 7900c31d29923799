#!/usr/bin/env bash
# The whole suite on one H200, as `make gpu-test` runs it (-m "not needs_index"), in two parts:
#   A. every test but the free-memory readers, six pytest-xdist workers sharing the card    <= PART_A s
#   B. the tests that read the device's free memory, alone                                    <= PART_B s
#   C. the figures still missing, the card alone, as time allows: the SWITCH launch over the
#      host-chosen replay, cold varlen with the on-disk caches warm, the wake
# Logs (JUnit XML, so every test's outcome survives a cut) under $OUT/suite/.
set -u -o pipefail
OUT="${OUT:?set OUT}"
D="$OUT/suite"
mkdir -p "$D"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
PY=python3
start=$(date +%s)
BUDGET=${BUDGET:-575}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
say() { echo "[suite $(( $(date +%s) - start ))s] $*" | tee -a "$D/log.txt"; }
MEMORY="tests/capture/test_reserved_memory_gpu.py tests/manager/test_capture_memory.py tests/manager/test_estimate.py
  tests/manager/test_kv_first.py tests/manager/test_kv_sizing.py tests/manager/test_run_loop.py
  tests/manager/test_sleep_cycles.py"
IGNORE=""
for f in $MEMORY; do IGNORE="$IGNORE --ignore=$f"; done
say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); torch $($PY -c 'import torch;print(torch.__version__)')"

timeout "${PART_A:-330}" $PY -m pytest -p no:cacheprovider -v -rfE -n 6 --dist loadfile --timeout=240 \
  -m "not needs_index" $IGNORE --junitxml="$D/a.xml" tests > "$D/a.log" 2>&1
say "A rc=$? $(tail -1 $D/a.log | cut -c1-160)"

timeout "${PART_B:-120}" $PY -m pytest -p no:cacheprovider -v -rfE --timeout=120 -m "not needs_index" \
  --junitxml="$D/b.xml" $MEMORY > "$D/b.log" 2>&1
say "B rc=$? $(tail -1 $D/b.log | cut -c1-160)"

export SHRINKLOOP_RUNS="$D/figures.jsonl" CUDAGRAPH_BENCH_DEFAULTS_LOG="$D/figures.jsonl"
export CUDAGRAPH_BENCH_DEFAULTS_ROUNDS=1 CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT=60
if [ "$(left)" -gt 30 ]; then
  timeout 30 $PY -m pytest -p no:cacheprovider -q --benchmark-only tests/benchmarks/test_bench_shrinking_loop.py \
    -k switch > "$D/c.log" 2>&1
  say "C switch rc=$?"
fi
if [ "$(left)" -gt 75 ]; then
  timeout 25 $PY -m tests.benchmarks.defaults cold --backend varlen --page-size 16 > /dev/null 2>> "$D/c.log"
  timeout "$(( $(left) - 5 ))" $PY -m pytest -p no:cacheprovider -q --benchmark-only \
    tests/benchmarks/test_bench_defaults.py -k "varlen or wake" >> "$D/c.log" 2>&1
  say "C varlen, wake rc=$?"
fi

$PY - "$D" <<'EOF'
import sys, pathlib, xml.etree.ElementTree as ET
d = pathlib.Path(sys.argv[1])
for part in ("a", "b"):
    f = d / f"{part}.xml"
    if not f.exists():
        print(part, "no junit"); continue
    root = ET.parse(f).getroot()
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad = []
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "error" if "error" in kinds else "skipped" if "skipped" in kinds else "passed"
        counts[kind] += 1
        if kind in ("failed", "error"):
            msg = next((c.get("message", "") for c in case if c.tag in ("failure", "error")), "")
            bad.append(f"{case.get('classname')}::{case.get('name')}: {msg[:300]}")
    print(part, counts)
    for line in bad[:40]:
        print("  BAD", line)
EOF
echo "--- figures"; [ -f "$D/figures.jsonl" ] && cut -c1-2500 "$D/figures.jsonl"
say "total"

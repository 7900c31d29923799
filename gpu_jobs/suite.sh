#!/usr/bin/env bash
# The GPU suite in two parts (one H200 each call), plus extra runs; logs under $OUT.
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
T="python3 -m pytest -p no:cacheprovider -q -m not\ needs_index --timeout=300"
case "$1" in
  1)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    python3 -m pytest -p no:cacheprovider -q -m "not needs_index" --timeout=300 tests/manager/test_[a-m]*.py tests/dispatch > "$OUT/suite1.txt" 2>&1
    echo "suite1 rc=$?"; tail -3 "$OUT/suite1.txt"
    timeout 60 python3 -m pytest -p no:cacheprovider -q tests/benchmarks/test_bench_capture.py -k per_break --benchmark-json="$OUT/per_break.json" > "$OUT/per_break.txt" 2>&1
    echo "per_break rc=$?"
    OUT=/tmp/o timeout 200 bash gpu_jobs/floor-paged.sh > /tmp/fp.txt 2>&1; echo "floor-paged rc=$?"
    cp /tmp/o/floor-paged/summary.txt "$OUT/paged_summary.txt"; cat /tmp/o/floor-paged/tests.txt | tail -3
    python3 - "$OUT/per_break.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    print(b["name"], {k: v for k, v in b["extra_info"].items() if "break" in k or "peer" in k})
PY
    cat "$OUT/paged_summary.txt";;
  2)
    python3 -m pytest -p no:cacheprovider -q -m "not needs_index" --timeout=300 tests/capture tests/manager/test_[n-z]*.py tests/test_*.py tests/benchmarks > "$OUT/suite2.txt" 2>&1
    echo "suite2 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/suite2.txt" | head -20; tail -3 "$OUT/suite2.txt";;
esac

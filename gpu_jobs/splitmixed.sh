#!/usr/bin/env bash
# issue 40, item 4 (branch splitmixed): split_decode's mixed batches on the varlen prefill path.
# Run from the repo root on one H200 (system python3, torch 2.11, pytest, pytest-benchmark); <= 90 s.
# Writes under $OUT/splitmixed/: run.txt + bench.json (1), planned.txt + planned.json (2), summary.txt.
# (1) one pytest process, SIGINT at 62 s (the session then ends cleanly: the JSON keeps what finished):
#   (a) the decider: test_paged_graph_vs_eager for varlen (the reference) and split_decode (its
#       varlen prefill path, the default) at decode 1/16/64 and mixed 512, eager and both graph
#       modes interleaved;
#   (b) the GPU correctness tests of split_decode (kernels, graphs of its varlen prefill path, the
#       manager against the oracle in every mode, the device loop, the support check).
# (2) in the time left (if >= 25 s): the baseline split_decode_planned (prefill="planned", the old
#     host-planned path) at mixed 512 (known: 0.88x/0.90x, eager 57-71 ms on an H200).
set -u
: "${OUT:?set OUT}"
dir="$OUT/splitmixed"
mkdir -p "$dir"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1);" \
    "torch $(python3 -c 'import importlib.metadata as m; print(m.version("torch"))' 2>&1)"
T="python3 -m pytest -p no:cacheprovider -q -m gpu"
bench="test_paged_graph_vs_eager and (varlen or split_decode)"

timeout -s INT -k 5 62 $T tests/benchmarks/test_bench_paged.py tests/manager/test_paged_kernels.py \
    tests/manager/test_support_check.py tests/manager/test_paged_backends.py tests/manager/test_decode_loop.py \
    -k "($bench) or (split_decode and not test_paged_graph_vs_eager)" \
    --benchmark-json="$dir/bench.json" > "$dir/run.txt" 2>&1
echo "(1) pytest rc=$? (0: all passed; 1: a failure; 124: interrupted at 62 s)"
grep -E "^(FAILED|ERROR)" "$dir/run.txt" | head -8; tail -1 "$dir/run.txt"

left=$((85 - SECONDS))
if [ "$left" -ge 25 ]; then
    CUDAGRAPH_BENCH_FLOOR_PLANNED=1 timeout -s INT -k 3 "$left" $T tests/benchmarks/test_bench_paged.py \
        -k "test_paged_graph_vs_eager and split_decode_planned and mixed512" \
        --benchmark-json="$dir/planned.json" > "$dir/planned.txt" 2>&1
    echo "(2) planned baseline rc=$? (124: interrupted)"; tail -1 "$dir/planned.txt"
else
    echo "(2) planned baseline skipped: ${left}s left"
fi

python3 - "$dir" > "$dir/summary.txt" 2>&1 <<'PY'
import json, pathlib, sys
rows = []
for name in ("bench.json", "planned.json"):
    path = pathlib.Path(sys.argv[1], name)
    if path.exists():
        try:
            rows += [b["extra_info"] for b in json.loads(path.read_text())["benchmarks"]]
        except Exception as error:
            print(name, "unreadable:", error)
print("eager/graph speed-up (>1: the graph is faster), median of paired rounds [min, max]")
print(f"{'backend':21}{'step':>10}{'eager us':>10}{'FULL us':>10}{'FULL':>18}{'F&P us':>10}{'F&P':>18}")
for r in sorted(rows, key=lambda r: (r["attention"], not r["uniform"], r["num_tokens"])):
    step = f"{'decode' if r['uniform'] else 'mixed'}{r['num_tokens']}"
    f, p = "manager_full", "manager_full_and_piecewise"
    fs, ps = r[f"eager_over_{f}_spread"], r[f"eager_over_{p}_spread"]
    cell = lambda ratio, s: f"{ratio:.2f} [{s[0]:.2f},{s[1]:.2f}]"
    print(f"{r['attention']:21}{step:>10}{r['eager_us']:10.0f}{r[f + '_us']:10.0f}{cell(r['eager_over_' + f], fs):>18}"
          f"{r[p + '_us']:10.0f}{cell(r['eager_over_' + p], ps):>18}")
PY
cat "$dir/summary.txt"
echo "total ${SECONDS}s"

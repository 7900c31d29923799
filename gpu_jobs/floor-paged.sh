#!/usr/bin/env bash
# issue 40, item 4 (branch floor-paged): the paged backends' graphs against their eager steps.
# Run from the repo root on one H200 (system python3, torch 2.11, pytest, pytest-benchmark); <= 150 s.
# Writes under $OUT/floor-paged/: tests.txt, env.txt, bench_*.json, bench_*.txt, summary.txt.
set -u
: "${OUT:?set OUT}"
dir="$OUT/floor-paged"
mkdir -p "$dir"
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
python3 - > "$dir/env.txt" 2>&1 <<'PY'
import inspect, torch
from torch.nn.attention import varlen
from examples.paged.row_gather import TRITON
from examples.paged.varlen_kernels import PAGED_VARLEN
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("varlen_attn", inspect.signature(varlen.varlen_attn))
print("PAGED_VARLEN", PAGED_VARLEN, "TRITON", TRITON)
PY
cat "$dir/env.txt"

# (a) the GPU tests of what changed: the varlen backend (kernels, graphs, manager replays vs eager).
timeout 45 python3 -m pytest -p no:cacheprovider -q -x \
    tests/manager/test_paged_varlen_bounds.py tests/manager/test_paged_kernels.py \
    "tests/manager/test_paged_backends.py" "tests/manager/test_paged.py" -k "varlen or gather_rows" \
    > "$dir/tests.txt" 2>&1
echo "tests rc=$? (124: timed out)"; tail -5 "$dir/tests.txt"

# (b) graph vs eager per backend at decode 1/16/64 and mixed 512 (4 8B-like layers); flex last (it compiles).
bench() {  # $1: label, $2: seconds, $3: -k expression
    timeout "$2" python3 -m pytest -p no:cacheprovider -q tests/benchmarks/test_bench_paged.py \
        --benchmark-only --benchmark-json="$dir/bench_$1.json" -k "test_paged_graph_vs_eager and ($3)" \
        > "$dir/bench_$1.txt" 2>&1
    echo "bench $1 rc=$? (124: timed out)"; tail -3 "$dir/bench_$1.txt"
}
bench others 120 "varlen or gather or split_decode"
bench flex 150 "flex"

python3 - "$dir" > "$dir/summary.txt" 2>&1 <<'PY'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    try:
        rows += [b["extra_info"] for b in json.loads(path.read_text())["benchmarks"]]
    except Exception as error:
        print(path.name, "unreadable:", error)
print("eager/graph speed-up (>1: the graph is faster), median of paired rounds [min, max]")
print(f"{'backend':13}{'step':>10}{'eager us':>10}{'FULL us':>10}{'FULL':>18}{'F&P us':>10}{'F&P':>18}{'mixed/unif':>11}")
for r in sorted(rows, key=lambda r: (r["attention"], not r["uniform"], r["num_tokens"])):
    step = f"{'decode' if r['uniform'] else 'mixed'}{r['num_tokens']}"
    f, p = "manager_full", "manager_full_and_piecewise"
    fs, ps = r[f"eager_over_{f}_spread"], r[f"eager_over_{p}_spread"]
    cell = lambda ratio, s: f"{ratio:.2f} [{s[0]:.2f},{s[1]:.2f}]"
    mu = r.get("full_mixed_key_over_uniform_key")
    print(f"{r['attention']:13}{step:>10}{r['eager_us']:10.0f}{r[f + '_us']:10.0f}{cell(r['eager_over_' + f], fs):>18}"
          f"{r[p + '_us']:10.0f}{cell(r['eager_over_' + p], ps):>18}{'' if mu is None else f'{mu:.3f}':>11}")
PY
cat "$dir/summary.txt"

#!/usr/bin/env bash
# enc-host (issue 42, host cost): the encoder's GPU tests and benchmarks on one H200, at most ~115 s (timeouts 12 + 40 + 60).
# Writes under "$OUT/enc-host/": summary.txt (read this first), host_bench.json (pytest-benchmark),
# throughput.json (python -m tests.benchmarks.encoder_throughput), tests.txt, and the stderr of each.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
D="${OUT:?OUT must be set}/enc-host"
mkdir -p "$D"
T0=$(date +%s)

# 1. Host cost per batch of 8 items: pack, route, build, total (target <= 20 us), the lengths tensor
#    and the former build's two launches (cumsum + fill) as the baseline in the same run.
timeout 12 python3 -m pytest -q -p no:cacheprovider tests/benchmarks/test_bench_encoder.py \
    --benchmark-only --benchmark-json="$D/host_bench.json" > "$D/host_bench.txt" 2>&1
echo "host_bench rc=$?" >> "$D/host_bench.txt"

# 2. Throughput graph vs eager (the 12-layer ViT), mismatches per item, padding waste, host breakdown.
timeout 40 python3 -m tests.benchmarks.encoder_throughput --mixes 32 --rounds 5 \
    > "$D/throughput.json" 2> "$D/throughput.err"
echo "throughput rc=$?" >> "$D/throughput.err"

# 3. The encoder's tests, GPU ones included (replay == eager per item under the new build).
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/manager/test_encoder_gpu.py \
    tests/manager/test_encoder.py > "$D/tests.txt" 2>&1
echo "tests rc=$?" >> "$D/tests.txt"

python3 - "$D" "$T0" > "$D/summary.txt" 2>&1 <<'PY'
import json, sys, time
d, t0 = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        with open(f"{d}/{name}") as f:
            return json.load(f)
    except Exception as e:  # a part that timed out or failed: say so, go on
        return {"error": repr(e)}
host = load("host_bench.json")
bench = (host.get("benchmarks") or [{}])[0]
print("host cost, 8 items, pytest-benchmark (us/batch):", round(bench.get("extra_info", {}).get("per_batch_us", float("nan")), 2))
print("  breakdown (us/batch):", {k: round(v, 2) for k, v in bench.get("extra_info", {}).get("breakdown_us", {}).items()})
tp = load("throughput.json")
keys = ("device", "graph_over_eager", "graph_items_per_s", "eager_items_per_s", "mismatches",
        "worst_relative_error", "padding_waste", "host_us_per_batch_of_8_items", "error")
for k in keys:
    if k in tp:
        v = tp[k]
        print(f"throughput {k}:", {a: round(b, 3) for a, b in v.items()} if isinstance(v, dict) else v)
with open(f"{d}/tests.txt") as f:
    lines = f.read().strip().splitlines()
print("tests:", " | ".join(lines[-2:]))
print("wall s:", int(time.time()) - t0)
PY
cat "$D/summary.txt"

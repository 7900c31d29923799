#!/usr/bin/env bash
# Issue 40, items 5 and 6: the wake's phases, the estimate's phases, the cold capture against its floor.
# One H200, from the repository root, <= 150 s; everything under $OUT/floor-wake/.
# Each step prints one JSON line (tests/benchmarks/floor_wake_profile.py says what is in it);
# stderr of each step beside it (the flex runs log dynamo's recompiles there, with their reasons).
# The figures are those of the benchmarks, same definitions, in less time: wake_first_step_minus_eager_ms
# (tests/benchmarks/test_bench_sleep.py), estimate over capture (memory_estimate.py), cold capture over
# the record + instantiate floor (startup.py); the benchmarks themselves do not fit in 150 s beside it.
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
D="$OUT/floor-wake"
mkdir -p "$D"
# The libraries' on-disk caches (inductor, Triton, CUDA's JIT) in a directory per backend: empty for
# a backend's first (cold) process, warm for its later ones.
C="$D/caches"
P="python3 -m tests.benchmarks.floor_wake_profile"
DEADLINE=145
step() {  # step NAME SECONDS CACHE ARGS...: one profile within its budget and what is left
  local name=$1 want=$2 cache="$C/$3"; shift 3
  local left=$((DEADLINE - SECONDS))
  local limit=$(( want < left ? want : left ))
  if (( limit < 5 )); then echo "skipped $name (no time left)" | tee -a "$D/summary.txt"; return; fi
  mkdir -p "$cache/inductor" "$cache/triton" "$cache/cuda"
  local t0=$SECONDS
  TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton" CUDA_CACHE_PATH="$cache/cuda" \
    timeout "$limit" $P "$@" >"$D/$name.json" 2>"$D/$name.err"
  local rc=$?
  echo "$name rc=$rc limit=${limit}s took=$((SECONDS - t0))s" | tee -a "$D/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$D/device.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" >>"$D/device.txt" 2>&1
step wake_reference 18 wake wake --model reference --cycles 2 --dynamo
step estimate_reference_512 18 estimate estimate --model reference --max-size 512
step cold_varlen_1_plain 13 varlen cold --backend varlen --plain
step cold_varlen_2_phased 13 varlen cold --backend varlen
step cold_flex_1_plain 32 flex cold --backend flex --plain --recompile-log
step cold_flex_2_plain_caches_warm 18 flex cold --backend flex --plain --recompile-log
step wake_8b_like 25 wake8b wake --model 8b_like --cycles 1 --dynamo
step cold_flex_3_phased_caches_warm 18 flex cold --backend flex --recompile-log
du -sh "$C"/* >>"$D/summary.txt" 2>&1
rm -rf "$C"  # large, and read by nothing after this run: not sent back
# A short digest of the figures the targets name.
python3 - "$D" <<'PY' >"$D/digest.txt" 2>&1
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
keys = {
    "wake": ["dynamo_loaded", "eager_step_ms", "new_rule_first_step_minus_eager_ms", "old_rule_first_step_minus_eager_ms",
             "new_rule_start_host_ms", "old_rule_start_host_ms", "new_rule_step_wait_ms", "old_rule_step_wait_ms",
             "new_rule_warm_ups_per_wake", "old_rule_warm_ups_per_wake", "new_rule_first_replay_ms", "new_rule_release_ms"],
    "estimate": ["estimate_over_capture", "estimate_error_pct", "probes", "phase_totals_ms", "phased_rest_ms", "capture_phases"],
    "cold": ["cold_capture_s", "cold_phases", "floor_record_instantiate_s", "cold_over_floor", "warm_over_floor",
             "no_warm_up_capture_s", "class_warm_up_s", "warm_up_wall_ms_sum", "warm_warm_up_wall_ms_sum",
             "first_use_ms_sum", "builder_ms_sum", "compiles_during_warm_ups"],
}
for path in sorted(d.glob("*.json")):
    lines = path.read_text().strip().splitlines()
    if not lines:
        print(f"{path.stem}: no output (see {path.stem}.err)"); continue
    r = json.loads(lines[-1])
    print(path.stem, {k: r.get(k) for k in keys[r["command"]]})
    if r["command"] == "cold":
        print("  slowest warm-ups (mode, tokens, ms, builder ms, compiles):",
              [(k["mode"], k["tokens"], k["wall_ms"], k["builder_ms"], k["compiles"]) for k in r["slowest_warm_ups"][:6]])
        print("  largest first-use costs (ms):", r["first_use_ms"][:6])
    if r["command"] == "estimate":
        print("  probe shares:", r["probe_share_simulation"])
PY
cat "$D/digest.txt"

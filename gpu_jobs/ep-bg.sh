#!/usr/bin/env bash
# ep-bg (issue 41: background capture with ranks, in lockstep), on a machine with 2 GPUs; <= 300 s.
# Run from the repo root. Everything it reports goes under "$OUT/ep-bg/".
set -u
export PYTHONPATH=packages/dispatch/src:packages/capture/src:packages/manager/src:.
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/ep-bg"
nvidia-smi -L > "$OUT/ep-bg/gpus.txt" 2>&1
SECONDS=0
summary() { grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|rank [01]: " | cut -c1-600; }
# 1. The new tests first: the EP decoder under background capture on 2 GPUs (300 steps, NCCL),
#    the lockstep capture with a planted failure (rank_worker "faults", 2 GPUs and CPU), the units.
timeout 140 python3 -m pytest -p no:cacheprovider -v -s --timeout=300 --basetemp="$OUT/ep-bg/pt1" \
  tests/manager/test_ep_moe.py::test_expert_parallel_decoder_under_background_capture_on_two_gpus \
  tests/manager/test_ep_moe.py::test_expert_parallel_decoder_under_background_capture_on_cpu \
  tests/manager/test_ranks.py::test_capture_faults_across_ranks_on_gpus \
  tests/manager/test_ranks.py::test_capture_faults_across_ranks_on_cpu \
  tests/manager/test_lockstep_capture.py 2>&1 | tee "$OUT/ep-bg/new.txt" | summary
echo "new: rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee "$OUT/ep-bg/rc.txt"
# 2. The rest of the EP module (the existing 2-GPU cases: the eager steps now read the agreed counts
#    from the forward context instead of an all-reduce), with the time left.
left=$((290 - SECONDS))
timeout "$left" python3 -m pytest -p no:cacheprovider -v -s --timeout=300 --basetemp="$OUT/ep-bg/pt2" \
  tests/manager/test_ep_moe.py --deselect \
  tests/manager/test_ep_moe.py::test_expert_parallel_decoder_under_background_capture_on_two_gpus \
  2>&1 | tee "$OUT/ep-bg/ep_moe.txt" | summary
echo "ep_moe: rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/ep-bg/rc.txt"

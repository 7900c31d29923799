"""One process of the memory-estimate benchmark: estimates against the capture they predict.

``python -m tests.benchmarks.memory_estimate MODEL MODE MAX_SIZE [--compiled]``:
``MODEL`` is ``reference`` (8 layers, d=1024) or ``8b_like``; ``MODE`` a
``CUDAGraphMode`` name; the plan is ``CaptureSizes.default(MAX_SIZE)``.

In a warm process (one estimate, capture and release first, so that lazy
initialization, compiles and autotuning are paid before anything is timed):
our ``estimate_memory()`` (timed), vLLM's profiling estimate
(``vllm_style_estimate``, timed), then the ``capture()`` they predict
(timed), whose drop of the device's free memory (``cudaMemGetInfo``) is the
truth. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, compile_for_capture
from examples.config import DecoderConfig
from examples.reference import ReferenceDecoder, static_inputs
from tests.benchmarks.vllm_estimate import vllm_style_estimate

MODELS = {"reference": DecoderConfig, "8b_like": DecoderConfig.llama_8b_like}


def main(model_name: str, mode_name: str, max_size: int, compiled: bool) -> dict[str, object]:
    torch.manual_seed(0)
    decoder = MODELS[model_name]()
    model = ReferenceDecoder(decoder, device="cuda", breakable=not compiled)
    inputs = static_inputs(decoder)
    runnable = compile_for_capture(model, inputs) if compiled else model.forward
    mode = CUDAGraphMode[mode_name]
    config = DispatchConfig(mode, CaptureSizes.default(max_size), max_num_seqs=decoder.max_num_seqs)
    manager = CUDAGraphManager(runnable, inputs, config)
    with torch.no_grad():
        manager.estimate_memory()  # the warm-up cycle: nothing below pays for a first use
        manager.capture(progress=False)
        manager.release()
        vllm_style_estimate(manager, runnable, inputs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ours = manager.estimate_memory()
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        vllm = vllm_style_estimate(manager, runnable, inputs)
        vllm_s = time.perf_counter() - start
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        report = manager.capture(progress=False)
        capture_s = time.perf_counter() - start
        measured = free_before - torch.cuda.mem_get_info()[0]
    mib = 2**20
    return {
        "model": model_name,
        "mode": mode_name,
        "compiled": compiled,
        "graphs": report.num_graphs,
        "measured_mib": measured / mib,
        "report_device_mib": report.device_bytes / mib,
        "report_error_pct": 100 * (report.device_bytes - measured) / measured,
        "ours_mib": ours.total_bytes / mib,
        "ours_error_mib": (ours.total_bytes - measured) / mib,
        "ours_error_pct": 100 * (ours.total_bytes - measured) / measured,
        "ours_s": ours_s,
        "ours_probes": len(ours.probes),
        "ours_warmup_mib": ours.warmup_bytes / mib,
        "ours_pool_mib": ours.pool_bytes / mib,
        "ours_driver_mib": ours.driver_bytes / mib,
        "vllm_mib": vllm / mib,
        "vllm_error_mib": (vllm - measured) / mib,
        "vllm_error_pct": 100 * (vllm - measured) / measured,
        "vllm_s": vllm_s,
        "capture_s": capture_s,
        "ours_probe_mib": [
            (p.mode.name, p.descriptor.num_tokens, p.pool_bytes / mib, p.driver_bytes / mib)
            for p in ours.probes
        ],
        "pool_growth_mib": [
            (g.descriptor.num_tokens, g.pool_bytes / mib) for g in report.graphs if g.pool_bytes
        ],
        "report_driver_mib": report.outside_allocator_bytes / mib,
        "ours_time_share": ours_s / capture_s,
        "vllm_time_share": vllm_s / capture_s,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    flags = {a for a in args if a.startswith("--")}
    model_arg, mode_arg, size_arg = (a for a in args if not a.startswith("--"))
    print(json.dumps(main(model_arg, mode_arg, int(size_arg), "--compiled" in flags)))

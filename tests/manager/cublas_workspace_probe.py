"""Graphs keep their cuBLAS workspace when torch drops its cache of them (run as a script).

``python -m tests.manager.cublas_workspace_probe [FULL|PIECEWISE] [--unfixed]``:
captures the reference decoder (bf16, 8 layers) at 1 and 16 tokens, then
does what torch does elsewhere: drops every cached cuBLAS workspace (as
inductor's CUDA graph trees do before recording; torch 2.11's
``CUDAGraph.reset`` drops its capture stream's), and empties the allocator's
cache (as ``torch.cuda.graph`` does on entry), so a freed workspace goes back
to the driver. Fresh tensors filled with a pattern then take the freed
memory, and the 1-token graph replays many times. Prints one JSON line: the
replay's error against eager and whether the fillers kept their pattern. A
workspace freed under a live graph shows as an illegal-address crash, a
corrupted filler or a wrong result. ``--unfixed`` turns the engines'
workspace handling off: the negative control.
"""

from __future__ import annotations

import json
import sys

import torch

from cudagraph_capture import _segment
from cudagraph_capture._pool import capture_stream
from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.torch_support import rel_err


def main() -> None:
    mode = CUDAGraphMode[sys.argv[1]]
    if "--unfixed" in sys.argv:
        _segment.drop_cublas_workspaces = lambda: None  # the negative control
    torch.manual_seed(0)
    config = DecoderConfig()
    decoder = ReferenceDecoder(config, device="cuda")
    manager = CUDAGraphManager(
        decoder, static_inputs(config), DispatchConfig(mode, CaptureSizes([1, 16]), config.max_num_seqs)
    )
    with torch.no_grad():
        manager.capture(progress=False)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fillers: list[tuple[torch.Tensor, float]] = []  # (tensor, the value written into it)
        for stream in (capture_stream(), torch.cuda.current_stream()):
            with torch.cuda.stream(stream):  # a freed block goes to new tensors of its stream first
                for n in (m for m in (32, 16, 8, 4, 2, 1) for _ in range(4)):  # 4 each of 32 .. 1 MiB
                    value = float(len(fillers) + 1)
                    fillers.append((torch.full((n << 18,), value, device="cuda"), value))
        torch.cuda.synchronize()
        errors = []
        for seed in range(20):
            step = make_step_inputs(
                config, 1, uniform_decode=True, generator=torch.Generator().manual_seed(seed), device="cuda"
            )
            errors.append(rel_err(manager.run_batch(step), decoder(**step)))
        torch.cuda.synchronize()
        intact = all(bool((f == value).all()) for f, value in fillers)
    print(json.dumps({"max_error": max(errors), "fillers_intact": intact}), flush=True)


if __name__ == "__main__":
    main()

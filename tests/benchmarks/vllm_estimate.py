"""vLLM's profiling estimate of CUDA graph memory, rebuilt over our manager for a side-by-side benchmark.

vLLM's V1 model runner (``GPUModelRunner.profile_cudagraph_memory``, on by
default since v0.21 through ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``)
captures, into a throwaway pool, the two largest graphs of each mode
(PIECEWISE first, then FULL), each with its warm-ups, and takes each one's
cost as the drop of the device's free memory around it (synchronized). With
``s1``, ``s2`` a mode's two samples and ``N`` its number of graphs, the
estimate is ``max over modes of s1 + sum over modes of (N - 1) * max(s2, 1 MiB)``
(the first captures share the pool; a mode with one graph has no ``s2`` and
costs 1 MiB per further graph). Then every sampled graph is freed and the
cache emptied. This is our code, written from that description, over the
manager's public surface: its plan, its static buffers, and engines of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import torch

from cudagraph_capture import (
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    GraphEngine,
    GraphEntry,
)
from cudagraph_capture._pool import capture_lock
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, StaticInput
from tests.benchmarks.startup import key_views

MIB: Final = 2**20
SAMPLES: Final = 2


def vllm_style_estimate(
    manager: CUDAGraphManager[torch.Tensor],
    model: Callable[..., torch.Tensor],
    inputs: Mapping[str, StaticInput],
) -> int:
    """vLLM's estimate of what capturing the manager's plan costs, in bytes (synchronizes).

    ``model`` and ``inputs`` are what the manager was built from.
    """
    device = manager.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # vLLM empties the cache once, at the start of its capture phase
    options = CaptureOptions(pool=torch.cuda.graph_pool_handle())
    entries: list[GraphEntry[torch.Tensor]] = []
    first: list[int] = []
    further = 0
    try:
        with torch.no_grad():
            for mode, keys in manager.dispatcher.capture_plan():
                engine: GraphEngine[torch.Tensor] = (
                    CUDAGraphWrapper(model, mode, options)
                    if mode is CUDAGraphMode.FULL
                    else BreakableCUDAGraphWrapper(model, options)
                )
                samples = []
                for key in keys[:SAMPLES]:
                    views = key_views(manager, inputs, key)
                    torch.cuda.synchronize(device)
                    free = torch.cuda.mem_get_info(device)[0]
                    engine.warm_up(key, views)
                    entries.append(engine.record(key, views))
                    torch.cuda.synchronize(device)
                    samples.append(free - torch.cuda.mem_get_info(device)[0])
                first.append(samples[0])
                per_graph = max(samples[1], MIB) if len(samples) > 1 else MIB
                further += (len(keys) - 1) * per_graph
    finally:
        with capture_lock(device):
            entries.clear()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return max(first) + further if first else 0

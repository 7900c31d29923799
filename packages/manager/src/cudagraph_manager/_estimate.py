"""What ``capture()`` will cost the device, predicted before it runs (``estimate_memory()``).

An engine sizes its KV cache from the memory left after the graphs, so it
needs their cost before it captures them. The estimate captures a few
*probe* keys for real, into a graph pool of its own, measures each, and
extrapolates along how a capture's cost grows:

- **Warm-ups.** The eager run of a mode's largest key leaves its
  activations' blocks in torch's cache, outside any graph pool; the
  capture's warm-ups do the same. Measured from an emptied cache, as the
  capture after the estimate starts from one, on a second run (the first
  pays one-time costs, such as kernels loaded on first use, that the
  capture would not pay again).
- **The pool.** Keys are captured largest first into one pool, so a mode's
  largest graph sets most of it and every smaller graph adds little (blocks
  that stay allocated, fragments).
- **The executables.** The driver's memory for a graph (for each segment of
  a breakable one) is about the same for every graph of a mode.

So, per mode, in plan order: the largest key is probed, then ``k`` keys
spread evenly over the others (about 5% of them, at least 2: the second
largest and the smallest included). The mode costs its probes as measured,
plus, for each key not probed, what the probes past the second largest
cost: the median of their pool growth (the second graph into a pool often
grows it once; later ones rarely, and in lumps that a mean would charge to
every key), and the mean executable of all the mode's probes (the driver
hands out memory in 2 MiB steps that several graphs share).
Each probe is warmed up and recorded as a capture would
(``GraphEngine.record``: nothing runs on the device). When the call
returns, the probes are freed and their pool's memory is back on the
device, with torch's whole cache (``torch.cuda.empty_cache()``). The driver
keeps the memory of the probes' executables for the graphs after them (a
few MiB; the capture that follows reuses it).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import torch

from cudagraph_capture import (
    CaptureDisabledError,
    CaptureError,
    GraphEngine,
    GraphEntry,
    GraphPool,
    capture_enabled,
    capture_lock,
    collector_paused,
    drop_cublas_workspaces,
)
from cudagraph_dispatch import CUDAGraphMode

from ._buffers import StaticBuffers
from ._capturing import free_bytes, reserved_bytes, warm_up
from ._planned import PlannedKey
from ._protocols import OutputT
from ._report import CapturedGraph, MemoryEstimate

#: The share of a mode's other keys probed after its largest (at least ``MIN_PROBES``).
PROBE_SHARE: Final = 0.05
MIN_PROBES: Final = 2

_K = TypeVar("_K")  # a planned key (tests pass stand-ins)

#: Engines that capture into a given pool, one per mode (the manager's factory, another pool).
ProbeEngines = Callable[[CUDAGraphMode, GraphPool], GraphEngine[OutputT]]


def probe_keys(keys: Sequence[_K]) -> list[_K]:
    """A mode's probes, largest first: its largest key, then ``k`` of the others spread evenly."""
    largest, others = keys[0], keys[1:]
    k = min(len(others), max(MIN_PROBES, math.ceil(PROBE_SHARE * len(others))))
    if k <= 1:
        return [largest, *others[:k]]
    picks = dict.fromkeys(round(i * (len(others) - 1) / (k - 1)) for i in range(k))
    return [largest, *(others[i] for i in picks)]


def estimate_memory(
    pending: Sequence[PlannedKey[OutputT]],
    make_engine: ProbeEngines[OutputT],
    buffers: StaticBuffers,
    device: torch.device,
    gc_disable: bool,
) -> MemoryEstimate:
    """Probe, measure and extrapolate (see the module docstring); synchronizes the calling stream."""
    start = time.perf_counter()
    if not capture_enabled():
        raise CaptureDisabledError("capture is disabled (set_capture_enabled(False))", None)
    by_mode: dict[CUDAGraphMode, list[PlannedKey[OutputT]]] = {}
    for key in pending:
        by_mode.setdefault(key.mode, []).append(key)
    stream = torch.cuda.current_stream(device)
    pool: GraphPool = torch.cuda.graph_pool_handle()  # the probes' own: freed with them
    engines = {mode: make_engine(mode, pool) for mode in by_mode}
    entries: list[GraphEntry[OutputT]] = []  # alive until the end: they keep the pool usable
    probes: list[CapturedGraph] = []
    pool_total = driver_total = 0
    with torch.cuda.device(device), torch.no_grad(), collector_paused(gc_disable):
        try:
            for _ in range(2):  # the second time measured: one-time costs (kernels' first loads) are paid
                # From an empty cache and no cached cuBLAS workspace, as the capture's warm-ups start
                # (the recordings before them dropped the workspaces).
                drop_cublas_workspaces()
                _empty_cache(device, stream)
                free_before = free_bytes(device)
                for mode, keys in by_mode.items():  # the largest of each mode: the capture's eager peak
                    _warm_up(keys[0], engines[mode], buffers)
                stream.synchronize()
            warmup = free_before - free_bytes(device)
            for mode, keys in by_mode.items():
                measured = [
                    _probe(key, engines[mode], buffers, entries, device, warm=i > 0)
                    for i, key in enumerate(probe_keys(keys))
                ]
                probes += measured
                pool_total += sum(p.pool_bytes for p in measured)  # the probes count as measured
                driver_total += sum(p.driver_bytes for p in measured)
                # Each unprobed key costs the median pool growth of the probes past the two
                # largest (the second graph into a pool often grows it once, later ones rarely
                # and in lumps, which a mean would charge to every key).
                tail = measured[2:] or measured[1:]
                unprobed = len(keys) - len(measured)
                if tail and unprobed:
                    pool_total += unprobed * int(statistics.median(p.pool_bytes for p in tail))
                    # The driver hands out its memory in 2 MiB steps, shared by several graphs:
                    # every probe of the mode is a sample of the per-graph mean.
                    driver_total += unprobed * sum(p.driver_bytes for p in measured) // len(measured)
        finally:
            with capture_lock(device):  # freeing graphs edits torch's registry that captures edit
                entries.clear()
            _empty_cache(device, stream)
    return MemoryEstimate(
        total_bytes=warmup + pool_total + driver_total,
        warmup_bytes=warmup,
        pool_bytes=pool_total,
        driver_bytes=driver_total,
        num_graphs=len(pending),
        probes=tuple(probes),
        seconds=time.perf_counter() - start,
    )


def _empty_cache(device: torch.device, stream: torch.cuda.Stream) -> None:
    stream.synchronize()
    with capture_lock(device):  # never while another thread captures on the device
        torch.cuda.empty_cache()


def _warm_up(key: PlannedKey[OutputT], engine: GraphEngine[OutputT], buffers: StaticBuffers) -> None:
    try:
        warm_up(key, engine, buffers)
    except CaptureError:
        raise
    except Exception as error:  # the model's own error at this size: name the key
        raise CaptureError(
            f"the warm-up failed with {type(error).__name__}: {error}", key.descriptor
        ) from error


def _probe(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    entries: list[GraphEntry[OutputT]],
    device: torch.device,
    *,
    warm: bool,
) -> CapturedGraph:
    """Warm ``key`` up (``warm``) and record it; what the recording cost, split as a capture's is."""
    start = time.perf_counter()
    if warm:
        _warm_up(key, engine, buffers)
    reserved, free = reserved_bytes(device), free_bytes(device)
    entries.append(engine.record(key.descriptor, key.inputs))
    pool_bytes = reserved_bytes(device) - reserved
    driver_bytes = free - free_bytes(device) - pool_bytes
    return CapturedGraph(key.mode, key.descriptor, time.perf_counter() - start, pool_bytes, driver_bytes)


def nothing_to_estimate(why: str) -> MemoryEstimate:
    """The estimate of a manager that captures nothing: 0, and why."""
    return MemoryEstimate(0, 0, 0, 0, 0, (), 0.0, not_estimated=why)

"""What ``capture()`` will cost the device, predicted before it runs (``estimate_memory()``).

An engine sizes its KV cache from the memory left after the graphs, so it
needs their cost before it captures them. The estimate captures a few
*probe* keys for real, into a graph pool of its own, measures each, and
extrapolates along how a capture's cost grows:

- **Warm-ups.** The eager run of a mode's largest key leaves its
  activations' blocks in torch's cache, outside any graph pool; the
  capture's warm-ups do the same. Measured from an emptied cache with no
  cached cuBLAS workspace, as the capture's warm-ups start, as the growth
  of torch's reserved memory: the driver memory a first run takes (kernels
  loaded on first use, library handles) the capture would not take again.
- **The pool.** Keys are captured largest first into one pool, so a mode's
  largest graph sets most of it. A smaller graph grows it only where the
  blocks, as the larger graphs split them, cannot serve its allocations:
  in a few ranges of sizes, once per range (at its top; the graphs below
  are served by what it added), by about one activation. Probes captured
  in plan order into one pool pay a range's growth when they fall into
  it, as the capture will; spread evenly over the sizes, they find every
  range wider than their spacing (about 185 tokens over 2,048 sizes), and
  may miss a narrower one, the estimate then being under by its growth.
  Measured on the 8B-like model over 2,048 sizes: 1,600 to 1,744 tokens
  (10 keys) grew it by 48 MiB (found), 16 to 128 by 6 MiB.
- **The executables.** The driver's memory for a graph (for each segment of
  a breakable one) is about the same for every graph of a mode.

So, per mode, in plan order: the largest key is probed, then ``k`` keys
spread evenly over the sizes of the others (about 8% of them, at least 2:
the second largest and the smallest included). The mode costs its probes
as measured (a range's growth included, once, as the capture pays it),
plus, for each key not probed: the least pool growth of the probes past
the second largest (what every graph adds, if anything: a range's growth
is not per key, and the second graph into a pool often grows it once),
and the mean executable of all the mode's probes (the driver hands out
memory in 2 MiB steps that several graphs share).
Each probe is recorded as a background capture records
(``GraphEngine.record``: nothing runs on the device), warmed up only if it
is the largest or the smallest of its mode (a compiled model may
specialize on the smallest size): the largest's warm-up did the lazy work,
and a warm-up at another size adds nothing to the pool (its blocks come
from the largest's, in torch's cache). So the probes cost little more
than their recordings, and the estimate a few percent of the capture's
time. When the call
returns, the probes are freed and their pool's memory is back on the
device, with torch's whole cache (``torch.cuda.empty_cache()``). The driver
keeps the memory of the probes' executables for the graphs after them (a
few MiB; the capture that follows reuses it).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import torch

from cudagraph_capture import (
    CaptureDisabledError,
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
from ._memory import reserved_bytes
from ._planned import PlannedKey
from ._protocols import OutputT
from ._report import CapturedGraph, MemoryEstimate

#: The share of a mode's other keys probed after its largest (at least ``MIN_PROBES``).
PROBE_SHARE: Final = 0.08
MIN_PROBES: Final = 2

_K = TypeVar("_K")  # a planned key (tests pass stand-ins)

#: Engines that capture into a given pool, one per mode (the manager's factory, another pool).
ProbeEngines = Callable[[CUDAGraphMode, GraphPool], GraphEngine[OutputT]]


def probe_keys(keys: Sequence[_K], tokens: Callable[[_K], int]) -> list[_K]:
    """A mode's probes, in plan order: its largest key, then ``k`` of the others spread over their sizes.

    ``keys`` are largest first; ``tokens`` gives a key's size. The ``k`` are
    the second largest, the smallest, and the keys nearest to sizes evenly
    spaced between them: even in tokens, not in keys, because a plan's keys
    are dense at small sizes and the pool's lumps are large at large ones.
    """
    largest, others = keys[0], keys[1:]
    k = min(len(others), max(MIN_PROBES, math.ceil(PROBE_SHARE * len(others))))
    if k <= 1:
        return [largest, *others[:k]]
    sizes = [-tokens(key) for key in others]  # ascending, for bisect
    high, low = sizes[0], sizes[-1]
    # The ends by position: of several keys of the smallest size (LoRA counts), the last is warmed up.
    picked = {0, len(others) - 1}
    for i in range(1, k - 1):
        target = high + i * (low - high) / (k - 1)
        at = bisect.bisect_left(sizes, target)
        # The nearest key not picked yet: outward from the target (k <= len(others), so one is left).
        near = sorted(
            range(max(0, at - k - 1), min(len(sizes), at + k + 1)), key=lambda j: abs(sizes[j] - target)
        )
        picked.add(next(j for j in near if j not in picked))
    return [largest, *(others[j] for j in sorted(picked))]


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
            warmup = measure_warm_ups(
                [(keys[0], engines[mode]) for mode, keys in by_mode.items()], buffers, device
            )
            for mode, keys in by_mode.items():
                measured = [
                    _probe(
                        key, engines[mode], buffers, entries, device, warm=key is keys[-1] and len(keys) > 1
                    )
                    for key in probe_keys(keys, _num_tokens)
                ]
                probes += measured
                pool_total += sum(p.pool_bytes for p in measured)  # the probes count as measured
                driver_total += sum(p.driver_bytes for p in measured)
                # Each unprobed key costs what every probe past the two largest grew the pool by:
                # the least of them (a range's growth is once, counted above; the second graph
                # into a pool often grows it once).
                tail = measured[2:]  # not empty where a key is unprobed: k >= 2 then
                unprobed = len(keys) - len(measured)
                if tail and unprobed:
                    pool_total += unprobed * max(0, min(p.pool_bytes for p in tail))
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


def measure_warm_ups(
    largest: Sequence[tuple[PlannedKey[OutputT], GraphEngine[OutputT]]],
    buffers: StaticBuffers,
    device: torch.device,
) -> int:
    """What the capture's warm-ups leave in torch's cache: each mode's largest key warmed up, measured.

    From an empty cache and no cached cuBLAS workspace, as the capture's
    warm-ups start (the recordings before them dropped the workspaces). The
    growth of reserved memory, not the drop of free memory: what a first run
    takes outside torch's allocator (kernels' first loads, library handles)
    stays with the process, and the capture does not take it again.
    """
    stream = torch.cuda.current_stream(device)
    drop_cublas_workspaces()
    _empty_cache(device, stream)
    reserved = reserved_bytes(device)
    for key, engine in largest:  # the capture's eager peak
        key.warm_up(engine, buffers)
    return reserved_bytes(device) - reserved


def _probe(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    entries: list[GraphEntry[OutputT]],
    device: torch.device,
    *,
    warm: bool,
) -> CapturedGraph:
    """Record ``key`` into ``entries`` (warmed up first if ``warm``: the smallest, as a background capture).

    A function of its own so that no local name outlives the probes: their
    graphs must die with ``entries``, or the pool stays reserved.
    """
    start = time.perf_counter()
    if warm:
        key.warm_up(engine, buffers)
    entry, captured = key.record(engine, device, start)
    entries.append(entry)
    return captured


def _num_tokens(key: PlannedKey[OutputT]) -> int:
    return key.num_tokens


def _empty_cache(device: torch.device, stream: torch.cuda.Stream) -> None:
    stream.synchronize()
    with capture_lock(device):  # never while another thread captures on the device
        torch.cuda.empty_cache()


def nothing_to_estimate(why: str) -> MemoryEstimate:
    """The estimate of a manager that captures nothing: 0, and why."""
    return MemoryEstimate(0, 0, 0, 0, 0, (), 0.0, not_estimated=why)

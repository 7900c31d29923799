"""What ``capture()`` will cost the device, predicted before it runs (``estimate_memory()``).

A mode's largest key and about 8% of its others (spread evenly in tokens)
are captured into a pool of their own and measured; the keys between them
are charged the least pool growth the probes past the second largest had,
and the mean executable of the mode's probes (``pick_probes``,
``extrapolate``, pure). The warm-ups' eager blocks are measured once. Tried
in issue 49 and kept only for the A/B (``RULE = "predicted"``): each mode's
two largest keys probed, block sizes apart (torch keeps blocks of up to
1 MiB in 2 MiB segments of their own, ``PoolUse``), and the rest of a
largest-first capture played on the pool they leave (``predict_pool``):
faster, but tens of MiB off where the probes' rule was exact. Why this
predicts a largest-first capture, and the figures: the manager README,
"Memory before capture".
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Final, Generic, TypeVar

import torch

from cudagraph_capture import GraphEngine
from cudagraph_capture._cublas import drop_cublas_workspaces
from cudagraph_capture._enabled import check_capture_enabled
from cudagraph_capture._gc import collector_paused
from cudagraph_capture._pool import GraphPool, capture_lock
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._memory._buffers import StaticBuffers
from .._memory._device import empty_cache, reserved_bytes
from .._values._protocols import OutputT
from .._values._reports import CapturedGraph, MemoryEstimate
from ._recording import record, warm_up
from ._table import PlannedGraph, by_mode
from ._warm_up import WarmUpClass, WarmUps, smallest_of_modes, warm_up_class

#: The share of a mode's other keys probed after its largest (at least ``MIN_PROBES``): the old rule.
PROBE_SHARE: Final = 0.08
MIN_PROBES: Final = 2
#: ``"probes"`` (the rule): the largest key and about 8% of the others probed (``pick_probes``,
#: ``extrapolate``); ``"predicted"``: each mode's two largest probed, the rest played on their
#: pool (``predict_pool``), tried in issue 49: faster, but tens of MiB off where the probes' rule
#: was exact. A switch for the benchmarks' A/B, not an option.
RULE = "probes"
#: The predicted rule's probes per mode: the largest key (the pool's first growth) and the next
#: (a second graph into a pool often grows it once more).
PREDICTED_PROBES: Final = 2
#: torch's caching allocator: requests up to 1 MiB (its small pool, which the pool's statistics
#: tell apart) take blocks of ``SMALL_SEGMENT`` segments; larger ones of ``LARGE_BUFFER`` segments
#: below ``MIN_LARGE_ALLOC``, else segments rounded up to ``ROUND_LARGE``; every request is rounded
#: up to ``MIN_BLOCK``.
SMALL_SEGMENT: Final = 2 << 20
LARGE_BUFFER: Final = 20 << 20
MIN_LARGE_ALLOC: Final = 10 << 20
ROUND_LARGE: Final = 2 << 20
MIN_BLOCK: Final = 512

_K = TypeVar("_K")  # a planned graph (tests pass stand-ins)

#: Engines that capture into a given pool, one per mode (the manager's factory, another pool).
ProbeEngines = Callable[[CUDAGraphMode, GraphPool], GraphEngine[OutputT]]


def pick_probes(planned: Sequence[_K], tokens: Callable[[_K], int]) -> list[_K]:
    """A mode's probes, in plan order: its largest key, then ``k`` of the others spread over their sizes.

    ``planned`` (a mode's graphs) are largest first; ``tokens`` gives one's size. The ``k`` are
    the second largest, the smallest, and the keys nearest to sizes evenly
    spaced between them: even in tokens, not in keys, because a plan's keys
    are dense at small sizes and the pool's lumps are large at large ones.
    """
    largest, others = planned[0], planned[1:]
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


def extrapolate(measured: Sequence[tuple[int, int]], num_keys: int) -> tuple[int, int]:
    """A mode's ``(pool, driver)`` bytes from its probes' ``(pool, driver)`` bytes, in plan order.

    The probes count as measured (a range's pool growth included, once, as
    the capture pays it). Each of the ``num_keys - len(measured)`` keys not
    probed costs the least pool growth of the probes past the two largest
    (what every graph adds, if anything: the second graph into a pool often
    grows it once), never below 0, and the mean driver bytes of all the
    probes (the driver hands out memory in 2 MiB steps that several graphs
    share).
    """
    if not measured:
        return 0, 0
    pool = sum(p for p, _ in measured)
    driver = sum(d for _, d in measured)
    unprobed = num_keys - len(measured)
    tail = measured[2:]  # not empty where a key is unprobed: pick_probes takes at least 2 then
    if tail and unprobed > 0:
        pool += unprobed * max(0, min(p for p, _ in tail))
        driver += unprobed * (driver // len(measured))  # driver: the probes' sum, so far
    return pool, driver


@dataclasses.dataclass(frozen=True, slots=True)
class PoolUse:
    """What one recording did to a pool, per block size: its growth and what it still holds after.

    ``small_reserved``, ``large_reserved``: the growth of torch's reserved
    memory in segments of small (up to 1 MiB) and large blocks;
    ``small_kept``, ``large_kept``: the growth of its allocated memory once
    the recording is done (outputs, tensors kept between segments). The rest
    of the growth held the recording's transients.
    """

    small_reserved: int
    large_reserved: int
    small_kept: int
    large_kept: int

    def of(self, *, small: bool) -> tuple[int, int]:
        """``(reserved, kept)`` of the small blocks, or of the large ones."""
        if small:
            return self.small_reserved, self.small_kept
        return self.large_reserved, self.large_kept


def predict_pool(probes: Sequence[tuple[int, PoolUse]], tokens: Sequence[int]) -> int:
    """The pool growth of a largest-first capture's keys after its ``probes``, played on their pool.

    ``probes``: ``(num_tokens, PoolUse)`` of the probed keys, largest first
    (the first from an empty pool); ``tokens``: each key not probed, in plan
    order. Per block size, each key's transients are the first probe's
    (its growth less what it kept) per token times its tokens, at most what
    the later probes' transients showed they fit in, and what it keeps the
    most any probe kept per token (rounded up to a block); where they do
    not fit in the pool as the keys before left it, it grows by the missing
    bytes in whole segments. Pure.
    """
    if not probes or not tokens:
        return 0
    first_tokens, first = probes[0]
    grown = 0
    for small, segment in ((True, _small_segment), (False, _large_segment)):
        first_reserved, first_kept = first.of(small=small)
        reserved = held = 0
        transient = max(0, first_reserved - first_kept) / max(1, first_tokens)
        kept = 0.0
        for n, use in probes:  # each probe's transients fit in the pool the ones before left
            use_reserved, use_kept = use.of(small=small)
            reserved += max(0, use_reserved)
            if held:
                transient = min(transient, max(0, reserved - held) / max(1, n))
            held += max(0, use_kept)
            kept = max(kept, max(0, use_kept) / max(1, n))
        start = reserved
        for n in tokens:
            need = held + math.ceil(transient * n)
            if need > reserved:
                reserved += segment(need - reserved)
            held += _block(math.ceil(kept * n)) if kept else 0
        grown += reserved - start
    return grown


def _block(size: int) -> int:
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def _small_segment(missing: int) -> int:
    return -(-missing // SMALL_SEGMENT) * SMALL_SEGMENT


def _large_segment(missing: int) -> int:
    if missing < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-missing // ROUND_LARGE) * ROUND_LARGE


def estimate_memory(
    pending: Sequence[PlannedGraph[OutputT]],
    make_engine: ProbeEngines[OutputT],
    buffers: StaticBuffers,
    gc_disable: bool,
    warm_ups: WarmUps,
    loops: LoopProbes[OutputT] | None = None,
    warmed_classes: frozenset[WarmUpClass] = frozenset(),
) -> MemoryEstimate:
    """Probe, measure and predict; synchronizes the calling stream (``loops``: a group of their own).

    ``warm_ups``: the capture's (the rule's); ``warmed_classes``: the warm-up
    classes a key of which was warmed up before (a probe of another class
    warms up first, as the capture would: nothing compiles inside a probe).
    The probes' own pool is freed at the end.
    """
    start = time.perf_counter()
    check_capture_enabled(None)
    device = buffers.device
    grouped = by_mode(pending)
    pool: GraphPool = torch.cuda.graph_pool_handle()  # the probes' own: freed with them
    engines = {mode: make_engine(mode, pool) for mode in grouped}
    kept: list[object] = []  # the probes' entries and loops, alive until the end: they keep the pool usable
    with torch.cuda.device(device), torch.no_grad(), collector_paused(gc_disable):
        try:
            largest = _largest_warmed(grouped, engines, warm_ups)
            warmup = measure_warm_ups(largest, buffers, device)
            # A probe warms up first where the capture would: each mode's smallest key (that
            # measure_warm_ups did not warm), and a key of a warm-up class no key warmed before.
            smallest = smallest_of_modes(pending) - {graph.descriptor for graph, _ in largest}
            classes = set(warmed_classes) | {warm_up_class(graph) for graph, _ in largest}
            probe = functools.partial(_probe, buffers=buffers, kept=kept, smallest=smallest, classes=classes)
            groups: list[tuple[list[PlannedGraph[OutputT]], _Probe[OutputT]]] = [
                (graphs, functools.partial(probe, engine=engines[mode])) for mode, graphs in grouped.items()
            ]
            if loops is not None and loops.graphs:  # the decode loops: a group of their own
                probe_loop = functools.partial(_probe_loop, loops=loops, pool=pool, kept=kept)
                groups.append((loops.graphs, probe_loop))
            probes, pool_total, driver_total = _probe_groups(groups, device)
        finally:
            with capture_lock(device):  # freeing graphs edits torch's registry that captures edit
                kept.clear()
            _empty_cache(device, torch.cuda.current_stream(device))
    return MemoryEstimate(
        total_bytes=warmup + pool_total + driver_total,
        warmup_bytes=warmup,
        pool_bytes=pool_total,
        driver_bytes=driver_total,
        num_graphs=len(pending) + (0 if loops is None else len(loops.graphs)),
        probes=tuple(probes),
        seconds=time.perf_counter() - start,
    )


_Probe = Callable[[PlannedGraph[OutputT]], CapturedGraph]


def _largest_warmed(
    grouped: dict[CUDAGraphMode, list[PlannedGraph[OutputT]]],
    engines: dict[CUDAGraphMode, GraphEngine[OutputT]],
    warm_ups: WarmUps,
) -> list[tuple[PlannedGraph[OutputT], GraphEngine[OutputT]]]:
    """Each mode's largest graph the capture warms up, with its engine: the capture's eager peak."""
    warmed = set(warm_ups.keys)
    return [
        (next(graph for graph in graphs if graph.descriptor in warmed), engines[mode])
        for mode, graphs in grouped.items()
        if any(graph.descriptor in warmed for graph in graphs)
    ]


def measure_warm_ups(
    largest: Sequence[tuple[PlannedGraph[OutputT], GraphEngine[OutputT]]],
    buffers: StaticBuffers,
    device: torch.device,
) -> int:
    """What the capture's warm-ups leave in torch's cache: each mode's largest graph warmed up, measured.

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
    for graph, engine in largest:  # the capture's eager peak
        warm_up(graph, engine, buffers)
    return reserved_bytes(device) - reserved


def _probe_groups(
    groups: Sequence[tuple[list[PlannedGraph[OutputT]], _Probe[OutputT]]],
    device: torch.device,
) -> tuple[list[CapturedGraph], int, int]:
    """Each group's probes recorded, and the ``(pool, driver)`` bytes of all its keys (``RULE``).

    ``"predicted"``: the group's ``PREDICTED_PROBES`` largest keys, the rest's pool
    played on theirs (``predict_pool``), each charged their mean driver bytes;
    ``"probes"``: ``pick_probes``, then ``extrapolate``.
    """
    probes: list[CapturedGraph] = []
    pool_total = driver_total = 0
    for graphs, probe in groups:
        if RULE == "probes":
            measured = [probe(graph) for graph in pick_probes(graphs, _num_tokens)]
            group_pool, group_driver = extrapolate(
                [(p.pool_bytes, p.driver_bytes) for p in measured], len(graphs)
            )
        else:
            picked, rest = graphs[:PREDICTED_PROBES], graphs[PREDICTED_PROBES:]
            uses: list[tuple[int, PoolUse]] = []
            measured = []
            for graph in picked:
                before = _pool_stats(device)
                measured.append(probe(graph))
                uses.append((graph.num_tokens, _pool_use(before, _pool_stats(device))))
            group_pool = sum(p.pool_bytes for p in measured) + predict_pool(
                uses, [g.num_tokens for g in rest]
            )
            group_driver = sum(p.driver_bytes for p in measured)
            group_driver += len(rest) * (group_driver // len(measured))
        probes += measured
        pool_total += group_pool
        driver_total += group_driver
    return probes, pool_total, driver_total


def _pool_stats(device: torch.device) -> tuple[int, int, int, int]:
    """torch's reserved and allocated bytes in small and large blocks, on ``device``."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before CUDA is initialized
    if not stats:
        return 0, 0, 0, 0
    reserved, allocated = stats["reserved_bytes"], stats["allocated_bytes"]
    return (
        int(reserved["small_pool"]["current"]),
        int(reserved["large_pool"]["current"]),
        int(allocated["small_pool"]["current"]),
        int(allocated["large_pool"]["current"]),
    )


def _pool_use(before: tuple[int, int, int, int], after: tuple[int, int, int, int]) -> PoolUse:
    small_reserved, large_reserved, small_kept, large_kept = (
        b - a for a, b in zip(before, after, strict=True)
    )
    return PoolUse(small_reserved, large_reserved, small_kept, large_kept)


def _probe(
    graph: PlannedGraph[OutputT],
    *,
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    kept: list[object],
    smallest: frozenset[BatchDescriptor],
    classes: set[WarmUpClass],
) -> CapturedGraph:
    """Record ``graph`` into ``kept``, warmed up first if in ``smallest`` (every capture warms them)
    or of a warm-up class not in ``classes`` (then added: its first use, a compile among them).

    ``smallest``: each mode's smallest key that ``measure_warm_ups`` did not
    warm already (it warms the first key of the mode that the capture warms:
    the largest on a first capture, the smallest on a recapture). A function of
    its own so that no local name outlives the probes: their graphs must die
    with ``kept``, or the pool stays reserved.
    """
    start = time.perf_counter()
    cls = warm_up_class(graph)
    warmed = graph.descriptor in smallest or cls not in classes
    classes.add(cls)
    if warmed:
        warm_up(graph, engine, buffers)
    entry, captured = record(
        graph, engine, buffers.device, start, time.perf_counter() - start if warmed else 0.0
    )
    kept.append(entry)
    return captured


@dataclasses.dataclass(frozen=True, slots=True)
class LoopProbes(Generic[OutputT]):
    """The decode loops a capture will add (largest first), and how to record one into a pool."""

    graphs: list[PlannedGraph[OutputT]]
    record: Callable[[PlannedGraph[OutputT], GraphPool], tuple[object, CapturedGraph]]


def _probe_loop(
    graph: PlannedGraph[OutputT], *, loops: LoopProbes[OutputT], pool: GraphPool, kept: list[object]
) -> CapturedGraph:
    """Record ``graph``'s decode loop into the probes' pool, kept in ``kept`` until the estimate ends."""
    loop, captured = loops.record(graph, pool)
    kept.append(loop)
    return captured


def _num_tokens(graph: PlannedGraph[OutputT]) -> int:
    return graph.num_tokens


def _empty_cache(device: torch.device, stream: torch.cuda.Stream) -> None:
    stream.synchronize()
    empty_cache(device)


def nothing_to_estimate(why: str) -> MemoryEstimate:
    """The estimate of a manager that captures nothing: 0, and why."""
    return MemoryEstimate(
        total_bytes=0,
        warmup_bytes=0,
        pool_bytes=0,
        driver_bytes=0,
        num_graphs=0,
        probes=(),
        seconds=0.0,
        no_graphs=why,
    )

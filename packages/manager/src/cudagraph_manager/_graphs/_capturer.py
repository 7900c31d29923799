"""A manager's captures: in the foreground, in a background thread, in lockstep with ranks, or probed.

Each planned graph is warmed up where the warm-up rule (and ``capture()``'s
policy, ``ManagerOptions.warm_ups``) says, recorded (nothing runs on the
device, so a serving step's memory is never written), its outputs checked,
then kept in the graph table: its key is captured. The capturer owns the
captures' lifecycle: the engines, the warm-up rule, the last capture thread,
with ranks the lockstep capture's part, whether the graphs were released,
the weights they read; the sessions (``_thread``, ``_lockstep``) ask it for
their jobs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Generic, TypeVar, cast

import torch

from cudagraph_capture import CaptureOptions, GraphEngine
from cudagraph_capture._gc import collector_paused
from cudagraph_capture._pool import GraphPool
from cudagraph_capture.lowlevel import release_graph_memory
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._memory._device import CaptureTotals, on_device
from .._memory._weights import WeightWatch, watched_module
from .._parts import ManagerParts
from .._values._inputs import signature_of
from .._values._protocols import BackgroundCapture, GraphEngineFactory, OutputT
from .._values._reports import CapturedGraph, CaptureReport, MemoryEstimate
from ..ranks import RankAgreement
from ._estimate import LoopProbes, estimate_memory, nothing_to_estimate
from ._lockstep import (
    Lockstep,
    LockstepCapture,
    Together,
    on_every_rank,
    plan_digest,
    planned,
    why_not_capture,
)
from ._loops import LoopCapture
from ._recording import capture_graph, warm_up
from ._table import GraphTable, PlannedGraph
from ._thread import BackgroundTimings, ThreadCapture
from ._warm_up import WarmUpRule

_logger: Final = logging.getLogger("cudagraph_manager")
T = TypeVar("T")


class Capturer(Generic[OutputT]):
    """A manager's captures of its graph table's pending graphs; the jobs the capture sessions ask of it.

    Holds one engine per mode, the warm-up rule, the decode loops' capture,
    the last capture thread (weakly: the session holds this object), with
    ranks the lockstep capture's part (``lockstep``, which every step's plan
    calls around its exchange), and whether the graphs were released. A
    capture thread's jobs are ``ThreadJobs``, a lockstep capture's
    ``LockstepJobs``.
    """

    __slots__ = (
        "__weakref__",  # the capture worker lives while a capturer that used it does
        "_engines",
        "_loops",
        "_options",
        "_parts",
        "_policy",
        "_rule",
        "_session",
        "_table",
        "background_timings",
        "lockstep",
        "released",
        "weights",
    )

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        table: GraphTable[OutputT],
        idle_step: Callable[[], Callable[[], None] | None],
    ) -> None:
        """``idle_step``: the manager's step of 0 tokens (a lockstep ``wait()`` takes them), held weakly."""
        self._parts: Final = parts
        self._policy: Final = parts.options.warm_ups  # capture()'s warm-ups
        self._table: Final = table
        self._options: Final = parts.capture_options
        # One engine per mode of the plan (none where nothing can be captured).
        graphs = table.graphs.values()
        modes = dict.fromkeys(graph.mode for graph in graphs) if parts.no_graphs is None else {}
        self._engines: Final[dict[CUDAGraphMode, GraphEngine[OutputT]]] = {
            mode: make_engine(parts.engine_factory, parts.model, mode, self._options) for mode in modes
        }
        self._rule: Final = WarmUpRule[OutputT]()
        # The decode loops (``run_loop``), captured by ``foreground`` after the keys; ``None``: no loops.
        self._loops: Final = None if parts.loop is None else LoopCapture(parts, parts.loop, table)
        #: How a background capture waits for the first step (tests set their own).
        self.background_timings = BackgroundTimings()
        # The last capture thread, weakly: it holds this object (its jobs), and a strong
        # reference back would keep the graphs alive after the manager goes, until a collection.
        # While it runs, its thread holds it.
        self._session: Callable[[], ThreadCapture | None] | None = None
        ranks = parts.ranks
        #: With ranks: the lockstep protocol's part of this rank (``start_capture()``; the steps' hook).
        self.lockstep: Final = (
            None
            if ranks is None
            else Lockstep(ranks, self, list(table.graphs), plan_digest(planned(table)), idle_step)
        )
        self.released = False  # release() freed the graphs, and no capture started since
        #: The addresses of the model's parameters and buffers that its graphs read.
        self.weights: Final = WeightWatch(watched_module(parts.model))

    # -- a capture thread's jobs (``ThreadJobs``) --

    @property
    def device(self) -> torch.device:
        return self._parts.device

    @property
    def gc_disable(self) -> bool:
        return self._options.gc_disable

    def start_totals(self) -> CaptureTotals:
        return CaptureTotals(self._parts.device)

    def report(
        self, totals: CaptureTotals, graphs: Sequence[CapturedGraph], why: str | None = None
    ) -> CaptureReport:
        """The phase's report; why nothing was captured is the manager's reason first."""
        parts = self._parts
        return totals.report(graphs, parts.no_graphs or why, parts.resolution, parts.kv_backing())

    def warm_up(self, descriptor: BatchDescriptor, *, skippable: bool) -> None:
        """The background capture's warm-up of ``descriptor``, timed for its key's report.

        A ``skippable`` warm-up is skipped where the warm-up rule says the
        thread has its handles (``WarmUpRule.thread_has_handles``; the weights
        kept since the last graphs: no recompile).
        """
        if skippable and self._rule.thread_has_handles(weights_kept=self.weights.kept):
            return
        start = time.perf_counter()
        graph = self._table.graphs[descriptor]
        with self._parts.lock.background():  # the model's calls on the manager are refused here
            warm_up(graph, self._engines[graph.mode], self._parts.buffers)
        self._rule.ran(descriptor, time.perf_counter() - start)

    def capture(self, descriptor: BatchDescriptor) -> CapturedGraph:
        """Record ``descriptor``'s graph, warmed up before (or never: the rule's)."""
        with self._parts.lock.background():
            return self._capture(descriptor, warm=False)

    # -- the manager's side --

    def begin(self, pending: Sequence[PlannedGraph[OutputT]]) -> None:
        """A capture of ``pending`` begins: new graphs read the weights as they are now, kept ones theirs."""
        self.released = False
        if self._parts.no_graphs is None:  # else no graph will read the weights: nothing to watch
            self.weights.before_capture(every_key=len(pending) == len(self._table.graphs))

    def foreground(
        self, pending: Sequence[PlannedGraph[OutputT]], ranks: RankAgreement | None, progress: bool | None
    ) -> CaptureReport:
        """Capture ``pending`` in order on this thread (with ranks, every rank's keys: ``on_every_rank``).

        A key is warmed up where the warm-up rule says (``WarmUpRule.for_capture``);
        with ranks every key, each kept by every rank or by none.
        """
        parts = self._parts
        if parts.no_graphs is not None:
            return CaptureReport(
                graphs=(),
                seconds=0.0,
                reserved_bytes=0,
                no_graphs=parts.no_graphs,
                resolution=parts.resolution,
                kv_cache=parts.kv_backing(),
            )
        warm_ups = self._rule.for_capture(pending, self._policy, ranks=ranks is not None)
        device = parts.device
        records: list[CapturedGraph] = []
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device(device):
            totals = self.start_totals()
            for graph in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                if ranks is None:
                    records.append(warm_ups.capture(graph, self._capture))
                    continue
                together = self._together(ranks, graph)
                if together.error is not None:
                    raise together.error
                assert together.record is not None
                records.append(together.record)
            loops, shrink_fallback = self._capture_loops()
            records += loops
            if device.type == "cuda":
                # Once, so the total includes the device's work: this stream only (it waited for
                # the capture stream), never the device, which would break another thread's capture.
                torch.cuda.current_stream(device).synchronize()
            return dataclasses.replace(self.report(totals, records), shrink_fallback=shrink_fallback)

    def background(
        self, pending: Sequence[PlannedGraph[OutputT]], keys_per_step: int = 1
    ) -> ThreadCapture | LockstepCapture:
        """Start capturing ``pending`` in a thread (``ThreadCapture``; returns once it warmed up), or,
        with ranks, in lockstep by the serving steps, ``keys_per_step`` a step (``LockstepCapture``)."""
        if self.lockstep is not None:
            return self.lockstep.start(keys_per_step)
        keys = [] if self._parts.no_graphs is not None else [graph.descriptor for graph in pending]
        session = ThreadCapture(
            keys, self._rule.background(pending, self._policy), self, timings=self.background_timings
        )
        self._session = weakref.ref(session)
        session.start()
        return session

    def running(self) -> BackgroundCapture | None:
        """The background capture still running, if one is (a thread's, or the lockstep one)."""
        thread = self.thread_capture()
        if thread is not None:
            return thread
        return None if self.lockstep is None else self.lockstep.session

    def thread_capture(self) -> ThreadCapture | None:
        """The capture thread still running, if one is."""
        session = None if self._session is None else self._session()
        return session if session is not None and not session.done else None

    # -- a lockstep capture's jobs (``LockstepJobs``) --

    def pending_keys(self) -> list[BatchDescriptor]:
        """The keys without a graph, in plan order (none where nothing can be captured)."""
        if self._parts.no_graphs is not None:
            return []
        return [graph.descriptor for graph in self._table.pending()]

    def why_not_capture(self) -> str | None:
        """Why this rank cannot capture now (no graphs, or captures turned off); ``None``: it can."""
        return why_not_capture(self._parts.no_graphs)

    def capture_together(self, key: BatchDescriptor) -> Together:
        """``key`` warmed up and recorded on the serving thread with every rank, kept by all or by none."""
        ranks = self._parts.ranks
        assert ranks is not None
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device(self._parts.device):
            return self._together(ranks, self._table.graphs[key])

    def _together(self, ranks: RankAgreement, graph: PlannedGraph[OutputT]) -> Together:
        """``graph`` captured on every rank (``on_every_rank``); a graph this rank held is dropped
        and recorded again with the others: only a recording meets a recording's collectives."""

        def attempt() -> CapturedGraph:
            if graph.entry is not None:
                self._table.drop(graph)
            return self._capture(graph.descriptor, warm=True)

        return on_every_rank(ranks, graph.descriptor, attempt, functools.partial(self._table.drop, graph))

    def estimate(
        self, pending: Sequence[PlannedGraph[OutputT]], ranks: RankAgreement | None
    ) -> MemoryEstimate:
        """What capturing ``pending`` costs the device (``_estimate``); synchronizes."""
        loops = self._loop_probes()
        parts = self._parts
        device = parts.device
        if parts.no_graphs is not None or not (pending or loops) or device.type != "cuda":
            return nothing_to_estimate(
                parts.no_graphs or ("every key is captured" if not pending else f"the device is {device}")
            )
        return estimate_memory(
            pending,
            self._probe_engine,
            parts.buffers,
            self._options.gc_disable,
            self._rule.foreground(pending, ranks=ranks is not None),
            loops,
            warmed_classes=self._rule.warmed_classes(list(self._table.graphs.values())),
        )

    def release(self) -> None:
        """Stop a background capture, free every graph, give the graph memory back to the device.

        Steps run eagerly as released until a capture starts; the memory goes
        back last, so the graphs are released even if that raises. A lockstep
        capture ends here at once (its ``wait()`` exchanges nothing then): the
        other ranks' end at the next step's exchange.
        """
        session = self.running()
        if session is not None:
            session.stop()
            session.wait()
        self.drop_all()
        self.released = True
        if self._parts.device.type == "cuda":
            release_graph_memory(self._parts.device)

    def drop_all(self) -> None:
        """Free every graph and decode loop (the pool stays, for the graphs captured next)."""
        self.weights.forget()  # no graph reads the model any more
        self._table.drop_all()

    def _capture_loops(self) -> tuple[list[CapturedGraph], str | None]:
        """The decode loop of every captured loopable graph that has none yet; why they do not shrink."""
        if self._loops is None or self._parts.device.type != "cuda":  # a loop is a CUDA graph (fakes: none)
            return [], None
        return self._loops.capture_missing(self._options)

    def _loop_probes(self) -> LoopProbes[OutputT] | None:
        """The decode loops ``capture()`` will add (every loopable graph without one), for the estimate."""
        loops = self._loops
        if loops is None or self._parts.device.type != "cuda":
            return None
        graphs = loops.missing(captured_only=False)
        if not graphs:
            return None

        def record_loop(graph: PlannedGraph[OutputT], pool: GraphPool) -> tuple[object, CapturedGraph]:
            return loops.record(graph, dataclasses.replace(self._options, pool=pool))

        return LoopProbes(graphs, record_loop)

    def _probe_engine(self, mode: CUDAGraphMode, pool: GraphPool) -> GraphEngine[OutputT]:
        """An engine of ``mode`` recording into ``pool``: the estimate's probes, in a pool of their own."""
        options = dataclasses.replace(self._options, pool=pool)
        return make_engine(self._parts.engine_factory, self._parts.model, mode, options)

    def _capture(self, descriptor: BatchDescriptor, *, warm: bool) -> CapturedGraph:
        graph = self._table.graphs[descriptor]
        parts = self._parts
        earlier = 0.0 if warm else self._rule.unreported(descriptor)
        captured = capture_graph(
            graph, self._engines[graph.mode], parts.buffers, parts.layout, warm=warm, warmed_seconds=earlier
        )
        self._rule.captured(descriptor)
        return captured


def make_engine(
    factory: GraphEngineFactory, model: Callable[..., OutputT], mode: CUDAGraphMode, options: CaptureOptions
) -> GraphEngine[OutputT]:
    """``factory(model, mode, options)``, checked to be a ``GraphEngine`` (else ``ValueError``)."""
    try:
        engine: object = factory(model, mode, options)
    except TypeError as error:
        if signature_of(factory) is not None:  # it takes the arguments (checked): the error is its own
            raise
        raise ValueError(
            f"options.engine_factory: {factory!r:.80} cannot be called as "
            f"factory(model, mode, options): {error}"
        ) from error
    lacks = [f"{member}()" for member in ("warm_up", "record") if not callable(getattr(engine, member, None))]
    if lacks:
        raise ValueError(
            f"options.engine_factory: returned {engine!r:.80} for mode {mode.name}, expected a GraphEngine; "
            f"it lacks {', '.join(lacks)}"
        )
    return cast("GraphEngine[OutputT]", engine)


def progress_bar(items: Sequence[T], *, desc: str, enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``items``, showing a bar when ``enabled`` (default: stderr is a terminal).

    The bar needs ``tqdm`` (the ``progress`` extra); without it this is a plain
    iteration. tqdm is imported here, on use, never at package import.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return iter(items)
    try:
        from tqdm import tqdm
    except ImportError:
        return iter(items)
    return iter(tqdm(items, desc=desc, unit="graph", leave=False))

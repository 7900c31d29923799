"""The capture of one planned key, shared by ``capture()`` and the background capture.

A key's capture is two acts. The warm-up runs the model eagerly on the key's
static views, filled with pad values first (never the last real batch: a
warm-up really runs, KV-cache writes included). The recording captures the
graph without running anything on the device (``GraphEngine.record``), so it
writes no memory a serving step may use: not the pool, whose free blocks may
hold the outputs of the last ``run()`` that a caller still reads, not the
static buffers, not the model's own buffers. The entry is checked (its
outputs must be cuttable), then stored on the key: the key is captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from collections.abc import Sequence
from typing import Final, Generic

import torch

from cudagraph_capture import (
    CaptureOptions,
    GraphEngine,
    GraphPool,
    capture_disabled_reason,
    capture_lock,
    check_capture_enabled,
    collector_paused,
    release_graph_memory,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode

from .._memory._weights import WeightWatch, watched_module
from .._parts import ManagerParts
from .._protocols import GraphEngineFactory, OutputT
from .._reports._report import CapturedGraph, CaptureReport, MemoryEstimate
from .._reports._totals import CaptureTotals
from .._step._buffers import StaticBuffers
from .._step._decode_loop import DecodeLoop, DecodeLoops
from .._step._outputs import LayoutCell
from ..ranks import RankAgreement
from ._background import BackgroundCapture, BackgroundTimings
from ._estimate import LoopProbes, estimate_memory, nothing_to_estimate
from ._planned import PlannedKey
from ._progress import progress as progress_bar
from ._warm_up import WarmUpRule


class Capturer(Generic[OutputT]):
    """A manager's captures: every pending key in the foreground, or in a background thread.

    Owns the plan's keys, one engine per mode, the warm-up rule, the decode
    loops, and the capture's lifecycle: the last background capture
    (held weakly: the session holds this object) and whether the graphs
    were released. It is the
    background capture's ``CaptureJobs``.
    """

    __slots__ = (
        "__weakref__",  # the capture worker lives while a capturer that used it does
        "_engines",
        "_factory",
        "_options",
        "_parts",
        "_rule",
        "_session",
        "background_timings",
        "keys",
        "loops",
        "released",
        "weights",
    )

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        factory: GraphEngineFactory,
        options: CaptureOptions,
        decode_loop: DecodeLoop[OutputT] | None = None,
    ) -> None:
        self._parts: Final = parts
        self._factory: Final = factory
        self._options: Final = options
        max_num_seqs = parts.dispatcher.config.max_num_seqs
        #: Every key of the plan, in capture order; its entry says whether it is captured.
        self.keys: Final = {
            key: PlannedKey[OutputT](mode, key, parts.buffers, max_num_seqs, parts.builder)
            for mode, keys in parts.dispatcher.capture_plan()
            for key in keys
        }
        # One engine per mode of the plan (none where nothing can be captured).
        modes = dict.fromkeys(key.mode for key in self.keys.values()) if parts.no_graphs is None else {}
        self._engines: Final[dict[CUDAGraphMode, GraphEngine[OutputT]]] = {
            mode: factory(parts.model, mode, options) for mode in modes
        }
        self._rule: Final = WarmUpRule[OutputT]()
        #: The decode loops (``run_loop``), captured by ``foreground`` after the keys; ``None``: no loops.
        self.loops: Final = None if decode_loop is None else DecodeLoops(parts, decode_loop, self.keys)
        #: How a background capture waits for the first step (tests set their own).
        self.background_timings = BackgroundTimings()
        # The last background capture, weakly: it holds this object (its jobs), and a strong
        # reference back would keep the graphs alive after the manager goes, until a collection.
        # While it runs, its thread holds it.
        self._session: weakref.ref[BackgroundCapture] | None = None
        self.released = False  # release() freed the graphs, and no capture started since
        #: The addresses of the model's parameters and buffers that its graphs read.
        self.weights: Final = WeightWatch(watched_module(parts.model))

    # -- the background capture's seam (``CaptureJobs``) --

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
        return totals.report(graphs, parts.no_graphs or why, parts.resolution)

    def warm_up(self, descriptor: BatchDescriptor, *, skippable: bool) -> None:
        """The background capture's warm-up of ``descriptor``, timed for its key's report.

        A ``skippable`` warm-up is skipped where the warm-up rule says the
        thread has its handles (``WarmUpRule.thread_has_handles``).
        """
        if skippable and self._rule.thread_has_handles():
            return
        start = time.perf_counter()
        key = self.keys[descriptor]
        key.warm_up(self._engines[key.mode], self._parts.buffers)
        self._rule.ran(descriptor, time.perf_counter() - start)

    def capture(self, descriptor: BatchDescriptor) -> CapturedGraph:
        """Record ``descriptor``'s graph, warmed up before (or never: the rule's)."""
        return self._capture(descriptor, warm=False)

    # -- the manager's side --

    def pending(self) -> list[PlannedKey[OutputT]]:
        """The keys not captured yet, in capture order."""
        return [key for key in self.keys.values() if key.entry is None]

    def begin(self, pending: Sequence[PlannedKey[OutputT]]) -> None:
        """A capture of ``pending`` begins: new graphs read the weights as they are now, kept ones theirs."""
        self.released = False
        if self._parts.no_graphs is None:  # else no graph will read the weights: nothing to watch
            self.weights.before_capture(every_key=len(pending) == len(self.keys))

    def foreground(
        self, pending: Sequence[PlannedKey[OutputT]], ranks: RankAgreement | None, progress: bool | None
    ) -> CaptureReport:
        """Capture ``pending`` in order on this thread (each key kept by every rank, or by none).

        A key is warmed up where the warm-up rule says (``WarmUpRule.foreground``).
        """
        parts = self._parts
        if parts.no_graphs is not None:
            return CaptureReport((), 0.0, 0, parts.no_graphs, resolution=parts.resolution)
        warm = set(self._rule.foreground(pending, ranks=ranks is not None).keys)
        device = parts.device
        records: list[CapturedGraph] = []
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device:
            totals = self.start_totals()
            for key in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                attempt = functools.partial(self._capture, key.descriptor, warm=key.descriptor in warm)
                if ranks is None:
                    records.append(attempt())
                else:
                    records.append(
                        ranks.all_or_none(key.descriptor, attempt, functools.partial(self.drop, key))
                    )
            records += self._capture_loops()
            if device.type == "cuda":
                # Once, so the total includes the device's work: this stream only (it waited for
                # the capture stream), never the device, which would break another thread's capture.
                torch.cuda.current_stream(device).synchronize()
            return self.report(totals, records)

    def background(self, pending: Sequence[PlannedKey[OutputT]]) -> BackgroundCapture:
        """Start capturing ``pending`` in a thread (see ``_background``); returns once it warmed up."""
        keys = [] if self._parts.no_graphs is not None else [key.descriptor for key in pending]
        session = BackgroundCapture(
            keys, self._rule.background(pending), self, timings=self.background_timings
        )
        self._session = weakref.ref(session)
        session.start()
        return session

    def running(self) -> BackgroundCapture | None:
        """The background capture still running, if one is."""
        session = None if self._session is None else self._session()
        return session if session is not None and not session.done else None

    def estimate(self, ranks: RankAgreement | None) -> MemoryEstimate:
        """What capturing the pending keys will cost the device (``_estimate``); synchronizes."""
        pending = self.pending()
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
        )

    def release(self) -> None:
        """Stop a background capture, free every graph, give the graph memory back to the device.

        Steps run eagerly as released until a capture starts; the memory goes
        back last, so the graphs are released even if that raises.
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
        with self._capture_lock():
            if self.loops is not None:
                self.loops.drop_all()
            for key in self.keys.values():
                key.drop()

    def drop(self, key: PlannedKey[OutputT]) -> None:
        """Free the key's graph (it is not captured any more), under the device's capture lock."""
        with self._capture_lock():
            key.drop()

    def _capture_lock(self) -> contextlib.AbstractContextManager[object]:
        """The device's capture lock: destroying a graph edits torch's registry that captures edit too."""
        device = self._parts.device
        return capture_lock(device) if device.type == "cuda" else contextlib.nullcontext()

    def _capture_loops(self) -> list[CapturedGraph]:
        """The decode loop of every captured uniform key of one token per request that has none yet."""
        loops = self.loops
        if loops is None or self._parts.device.type != "cuda":  # a loop is a CUDA graph (fakes: none)
            return []
        keys = [key for key in self.keys.values() if key.entry is not None and loops.loopable(key)]
        return [
            g
            for key in keys
            if key.descriptor not in loops.loops
            for g in loops.capture_or_log(key, self._options)
        ]

    def _loop_probes(self) -> LoopProbes[OutputT] | None:
        """The decode loops ``capture()`` will add (every loopable key without one), for the estimate."""
        loops = self.loops
        if loops is None or self._parts.device.type != "cuda":
            return None
        keys = [k for k in self.keys.values() if loops.loopable(k) and k.descriptor not in loops.loops]
        if not keys:
            return None

        def record(key: PlannedKey[OutputT], pool: GraphPool) -> tuple[object, CapturedGraph]:
            return loops.record(key, dataclasses.replace(self._options, pool=pool))

        return LoopProbes(keys, record)

    def _probe_engine(self, mode: CUDAGraphMode, pool: GraphPool) -> GraphEngine[OutputT]:
        """An engine of ``mode`` recording into ``pool``: the estimate's probes, in a pool of their own."""
        return self._factory(self._parts.model, mode, dataclasses.replace(self._options, pool=pool))

    def _capture(self, descriptor: BatchDescriptor, *, warm: bool) -> CapturedGraph:
        key = self.keys[descriptor]
        parts = self._parts
        earlier = 0.0 if warm else self._rule.unreported(descriptor)
        record = capture_key(
            key, self._engines[key.mode], parts.buffers, parts.layout, warm=warm, warmed_seconds=earlier
        )
        self._rule.captured(descriptor)
        return record


def capture_key(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    layout: LayoutCell,
    *,
    warm: bool,
    warmed_seconds: float = 0.0,
) -> CapturedGraph:
    """Warm the key up (``warm``), record its graph, check its outputs, store the entry on the key.

    ``warmed_seconds``: a warm-up of this key run earlier (the background
    capture's), counted in its seconds. ``CaptureError`` from the engine, or
    ``ValueError`` naming an output that cannot be cut, leaves the key uncaptured.
    """
    start = time.perf_counter() - warmed_seconds
    check_capture_enabled(key.descriptor)  # before the warm-up: a disabled capture runs nothing
    if warm:
        key.warm_up(engine, buffers)
    warmup = time.perf_counter() - start if warm else warmed_seconds
    entry, captured = key.record(engine, buffers.device, start, warmup)
    layout.of(entry.output).check(entry.output, key.num_tokens, key.num_reqs)
    key.keep(entry)  # last: the serving thread replays the key from its next step
    return captured


def agree_plan(
    ranks: RankAgreement | None, pending: Sequence[PlannedKey[OutputT]], no_graphs: str | None
) -> None:
    """With ``ranks``: every rank captures (or probes) the same keys, or all raise before any."""
    if ranks is not None:
        why = no_graphs or capture_disabled_reason()
        ranks.agree_plan([(key.mode, key.descriptor) for key in pending], no_graphs=why)

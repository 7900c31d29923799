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
import threading
import time
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

from .._memory._compiled import dynamo_compiles
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
from ._planned import PlannedKey, by_mode
from ._progress import progress as progress_bar


class Capturer(Generic[OutputT]):
    """A manager's captures: every pending key in the foreground, or in a background thread."""

    __slots__ = (
        "__weakref__",  # the capture worker lives while a capturer that used it does
        "_buffers",
        "_device",
        "_engines",
        "_factory",
        "_layout",
        "_model",
        "_no_graphs",
        "_options",
        "_resolution",
        "_thread_state",
        "_warmed",
        "background_timings",
        "keys",
        "loops",
    )

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        factory: GraphEngineFactory,
        options: CaptureOptions,
        decode_loop: DecodeLoop[OutputT] | None = None,
    ) -> None:
        self._model: Final = parts.model
        self._factory: Final = factory
        self._no_graphs: Final = parts.no_graphs  # why this manager captures nothing, or None
        self._resolution: Final = parts.dispatcher.resolution  # for the reports
        self._buffers: Final = parts.buffers
        self._layout: Final = parts.layout
        self._device: Final = parts.device
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
        #: Per thread: whether a warm-up of this manager ran on it (its library handles exist).
        self._thread_state: Final = threading.local()
        #: The decode loops (``run_loop``), captured by ``foreground`` after the keys; ``None``: no loops.
        self.loops: Final = None if decode_loop is None else DecodeLoops(parts, decode_loop, self.keys)
        #: Keys warmed up once (lazy initialization, compiles and autotuning are done for them),
        #: with the seconds of a warm-up not yet counted in a report.
        self._warmed: Final[dict[BatchDescriptor, float]] = {}
        #: How a background capture waits for the first step (tests set their own).
        self.background_timings = BackgroundTimings()

    def foreground(
        self, pending: Sequence[PlannedKey[OutputT]], ranks: RankAgreement | None, progress: bool | None
    ) -> CaptureReport:
        """Capture ``pending`` in order on this thread (each key kept by every rank, or by none).

        A key is warmed up where that is needed (``_needs_warm_up``).
        """
        if self._no_graphs is not None:
            return CaptureReport((), 0.0, 0, self._no_graphs, resolution=self._resolution)
        warm = self._needs_warm_up(pending, ranks)
        device = self._device
        records: list[CapturedGraph] = []
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device:
            totals = CaptureTotals(device, self._resolution)
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
            return totals.report(records)

    def _capture_loops(self) -> list[CapturedGraph]:
        """The decode loop of every captured uniform key of one token per request that has none yet."""
        loops = self.loops
        if loops is None or self._device.type != "cuda":  # a loop is a CUDA graph (fake engines: none)
            return []
        keys = [key for key in self.keys.values() if key.entry is not None and loops.loopable(key)]
        return [
            g
            for key in keys
            if key.descriptor not in loops.loops
            for g in loops.capture_or_log(key, self._options)
        ]

    def background(self, pending: Sequence[PlannedKey[OutputT]]) -> BackgroundCapture:
        """Start capturing ``pending`` in a thread (see ``_background``); returns once it warmed up.

        The thread warms up the largest and the smallest pending key of each
        mode; the largest only if no earlier capture of this manager warmed
        it up (a wake after ``release()``: its compiles, autotuning and
        allocator blocks stay). The smallest creates a new thread's cuBLAS
        handles, which a recording cannot (tried: a wake without it fails with
        ``CUBLAS_STATUS_NOT_INITIALIZED``); on the capture worker, which kept
        them from a capture of this manager before, it is skipped where no
        model is compiled (a recompile after new weights would need it).
        """
        warm: dict[BatchDescriptor, None] = {}
        for_thread: set[BatchDescriptor] = set()  # warmed for the thread's handles only
        for of_mode in by_mode(pending).values():
            first, last = of_mode[0].descriptor, of_mode[-1].descriptor
            largest = () if first in self._warmed else (first,)
            warm |= dict.fromkeys((*largest, last))
            if last not in largest:
                for_thread.add(last)
        session = BackgroundCapture(
            [key.descriptor for key in pending],
            list(warm),
            functools.partial(self._warm_up, for_thread=frozenset(for_thread)),
            functools.partial(self._capture, warm=False),
            self._device,
            self._options.gc_disable,
            self._no_graphs,
            self._resolution,
            self,
            timings=self.background_timings,
        )
        session.start()
        return session

    def _needs_warm_up(
        self, pending: Sequence[PlannedKey[OutputT]], ranks: RankAgreement | None
    ) -> set[BatchDescriptor]:
        """The keys a foreground capture warms up: each one's first use, and the smallest of each mode.

        A key's first use precedes its recording: a compile for its size (a
        compile inside a recording fails), library plans for its shapes
        (cuDNN's attention builds one per shape, slower inside a capture),
        its eager allocator blocks. A key this manager warmed before (a
        recapture: ``clear()``, ``release()`` and a wake, new weights) has
        them all; only the smallest of each mode is warmed again, for the
        capturing thread's cuBLAS handles and a recompile that new weights
        may cause (one compile serves every size of a dynamic graph). With
        ``ranks``, every key (a tensor-parallel warm-up holds collectives, so
        every rank must run the same ones, whatever each one warmed before).
        """
        if ranks is not None:
            return {key.descriptor for key in pending}
        warm = {key.descriptor for key in pending if key.descriptor not in self._warmed}
        warm.update(of_mode[-1].descriptor for of_mode in by_mode(pending).values())  # each mode's smallest
        return warm

    def pending(self) -> list[PlannedKey[OutputT]]:
        """The keys not captured yet, in capture order."""
        return [key for key in self.keys.values() if key.entry is None]

    def estimate(self, ranks: RankAgreement | None) -> MemoryEstimate:
        """What capturing the pending keys will cost the device (``_estimate``); synchronizes."""
        pending = self.pending()
        loops = self._loop_probes()
        if self._no_graphs is not None or not (pending or loops) or self._device.type != "cuda":
            return nothing_to_estimate(
                self._no_graphs
                or ("every key is captured" if not pending else f"the device is {self._device}")
            )
        return estimate_memory(
            pending,
            self._probe_engine,
            self._buffers,
            self._device,
            self._options.gc_disable,
            self._needs_warm_up(pending, ranks),
            loops,
        )

    def _loop_probes(self) -> LoopProbes[OutputT] | None:
        """The decode loops ``capture()`` will add (every loopable key without one), for the estimate."""
        loops = self.loops
        if loops is None or self._device.type != "cuda":
            return None
        keys = [k for k in self.keys.values() if loops.loopable(k) and k.descriptor not in loops.loops]
        if not keys:
            return None

        def record(key: PlannedKey[OutputT], pool: GraphPool) -> tuple[object, CapturedGraph]:
            return loops.record(key, dataclasses.replace(self._options, pool=pool))

        return LoopProbes(keys, record)

    def _probe_engine(self, mode: CUDAGraphMode, pool: GraphPool) -> GraphEngine[OutputT]:
        """An engine of ``mode`` recording into ``pool``: the estimate's probes, in a pool of their own."""
        return self._factory(self._model, mode, dataclasses.replace(self._options, pool=pool))

    def drop_all(self) -> None:
        """Free every graph and decode loop (the pool stays, for the graphs captured next)."""
        if self.loops is not None:
            with capture_lock(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
                self.loops.drop_all()
        for key in self.keys.values():
            self.drop(key)

    def release_memory(self) -> None:
        """Give the device's graph memory back to it (``release_graph_memory``): after ``drop_all()``."""
        if self._device.type == "cuda":
            release_graph_memory(self._device)

    def drop(self, key: PlannedKey[OutputT]) -> None:
        """Free the key's graph (it is not captured any more), under the device's capture lock.

        Destroying a graph edits torch's registry of live graphs that a capture
        in another thread edits too: never both at once.
        """
        cuda = self._device.type == "cuda"
        with capture_lock(self._device) if cuda else contextlib.nullcontext():
            key.entry = key.last_cut = None

    def _warm_up(self, descriptor: BatchDescriptor, *, for_thread: frozenset[BatchDescriptor]) -> None:
        """The background capture's warm-up of ``descriptor``, timed for its key's report.

        A key in ``for_thread`` is skipped on a thread that warmed up for this
        manager before (the capture worker: its handles exist), unless dynamo
        is loaded (a compiled model may recompile after new weights).
        """
        thread = self._thread_state
        if descriptor in for_thread and getattr(thread, "warmed", False) and dynamo_compiles() is None:
            return
        start = time.perf_counter()
        key = self.keys[descriptor]
        key.warm_up(self._engines[key.mode], self._buffers)
        self._warmed[descriptor] = time.perf_counter() - start
        thread.warmed = True

    def _capture(self, descriptor: BatchDescriptor, *, warm: bool) -> CapturedGraph:
        key = self.keys[descriptor]
        earlier = 0.0 if warm else self._warmed.get(descriptor, 0.0)
        record = capture_key(
            key,
            self._engines[key.mode],
            self._buffers,
            self._layout,
            self._device,
            warm=warm,
            warmed_seconds=earlier,
        )
        self._warmed[descriptor] = 0.0  # its first use is behind it; its warm-up counted in a report
        return record


def capture_key(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    layout: LayoutCell,
    device: torch.device,
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
    entry, captured = key.record(engine, device, start, warmup)
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

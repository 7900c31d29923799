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
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Final, Generic

import torch

from cudagraph_capture import (
    CaptureDisabledError,
    CaptureOptions,
    GraphEngine,
    capture_enabled,
    capture_lock,
    collector_paused,
    release_graph_memory,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, ModeResolution

from ._background import BackgroundCapture
from ._buffers import StaticBuffers
from ._compiled import compiles_since, dynamo_compiles
from ._estimate import ProbeEngines, estimate_memory, nothing_to_estimate
from ._memory import free_bytes, reserved_bytes
from ._outputs import LayoutCell
from ._planned import PlannedKey
from ._progress import progress as progress_bar
from ._protocols import OutputT
from ._report import CapturedGraph, CaptureReport, MemoryEstimate
from .ranks import RankAgreement


class Capturer(Generic[OutputT]):
    """A manager's captures: every pending key in the foreground, or in a background thread."""

    __slots__ = (
        "_buffers",
        "_device",
        "_engines",
        "_keys",
        "_layout",
        "_options",
        "_probe_engines",
        "_resolution",
        "_warmed",
    )

    def __init__(
        self,
        keys: Mapping[BatchDescriptor, PlannedKey[OutputT]],
        engines: Mapping[CUDAGraphMode, GraphEngine[OutputT]],
        probe_engines: ProbeEngines[OutputT],
        buffers: StaticBuffers,
        layout: LayoutCell,
        device: torch.device,
        options: CaptureOptions,
        resolution: ModeResolution | None = None,
    ) -> None:
        self._keys: Final = keys
        self._resolution: Final = resolution  # for the reports
        self._engines: Final = engines
        self._probe_engines: Final = probe_engines  # the estimate's: engines into a pool of its own
        self._buffers: Final = buffers
        self._layout: Final = layout
        self._device: Final = device
        self._options: Final = options
        #: Keys warmed up once: lazy initialization, compiles and autotuning are done for them.
        self._warmed: Final[set[BatchDescriptor]] = set()

    def foreground(
        self, pending: Sequence[PlannedKey[OutputT]], ranks: RankAgreement | None, progress: bool | None
    ) -> CaptureReport:
        """Capture ``pending`` in order on this thread (each key kept by every rank, or by none)."""
        device = self._device
        compiled_before = dynamo_compiles()
        records: list[CapturedGraph] = []
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device:
            reserved_before, free_before = reserved_bytes(device), free_bytes(device)
            start = time.perf_counter()
            for key in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                attempt = functools.partial(self._capture, key.descriptor, warm=True)
                if ranks is None:
                    records.append(attempt())
                else:
                    records.append(
                        ranks.all_or_none(key.descriptor, attempt, functools.partial(self.drop, key))
                    )
            if device.type == "cuda":
                # Once, so the total includes the device's work: this stream only (it waited for
                # the capture stream), never the device, which would break another thread's capture.
                torch.cuda.current_stream(device).synchronize()
            seconds = time.perf_counter() - start
            reserved = reserved_bytes(device) - reserved_before
            lost = free_before - free_bytes(device)
        return CaptureReport(
            tuple(records),
            seconds,
            reserved,
            compiles=compiles_since(compiled_before),
            device_bytes=lost,
            resolution=self._resolution,
        )

    def nothing(self, not_captured: str) -> CaptureReport:
        """The report of a capture that cannot capture anything, and why."""
        return CaptureReport((), 0.0, 0, not_captured, resolution=self._resolution)

    def background(
        self, pending: Sequence[PlannedKey[OutputT]], not_captured: str | None
    ) -> BackgroundCapture:
        """Start capturing ``pending`` in a thread (see ``_background``); returns once it warmed up.

        The thread warms up the largest and the smallest pending key of each
        mode; the largest only if no earlier capture of this manager warmed
        it up (a wake after ``release()``: its compiles, autotuning and
        allocator blocks stay). The smallest always: it creates the new
        thread's cuBLAS handles, which a recording cannot (tried: a wake
        without it fails with ``CUBLAS_STATUS_NOT_INITIALIZED``).
        ``not_captured``: why this manager captures nothing (its report says so), or ``None``.
        """
        warm: dict[BatchDescriptor, None] = {}
        for mode in dict.fromkeys(key.mode for key in pending):
            of_mode = [key.descriptor for key in pending if key.mode is mode]
            largest = () if of_mode[0] in self._warmed else (of_mode[0],)
            warm |= dict.fromkeys((*largest, of_mode[-1]))
        session = BackgroundCapture(
            [key.descriptor for key in pending],
            list(warm),
            self._warm_up,
            functools.partial(self._capture, warm=False),
            self._device,
            self._options.gc_disable,
            not_captured,
            self._resolution,
        )
        session.start()
        return session

    def pending(self) -> list[PlannedKey[OutputT]]:
        """The keys not captured yet, in capture order."""
        return [key for key in self._keys.values() if key.entry is None]

    def estimate(self, not_captured: str | None) -> MemoryEstimate:
        """What capturing the pending keys will cost the device (``_estimate``); synchronizes."""
        pending = self.pending()
        if not_captured is not None or not pending or self._device.type != "cuda":
            return nothing_to_estimate(
                not_captured or ("every key is captured" if not pending else f"the device is {self._device}")
            )
        return estimate_memory(
            pending, self._probe_engines, self._buffers, self._device, self._options.gc_disable
        )

    def drop_all(self) -> None:
        """Free every graph (the pool stays, for the graphs captured next)."""
        for key in self._keys.values():
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

    def _warm_up(self, descriptor: BatchDescriptor) -> None:
        key = self._keys[descriptor]
        key.warm_up(self._engines[key.mode], self._buffers)
        self._warmed.add(descriptor)

    def _capture(self, descriptor: BatchDescriptor, *, warm: bool) -> CapturedGraph:
        key = self._keys[descriptor]
        record = capture_key(
            key, self._engines[key.mode], self._buffers, self._layout, self._device, warm=warm
        )
        if warm:
            self._warmed.add(descriptor)
        return record


def capture_key(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    layout: LayoutCell,
    device: torch.device,
    *,
    warm: bool,
) -> CapturedGraph:
    """Warm the key up (``warm``), record its graph, check its outputs, store the entry on the key.

    ``CaptureError`` from the engine, or ``ValueError`` naming an output that
    cannot be cut, leaves the key uncaptured.
    """
    start = time.perf_counter()
    if not capture_enabled():  # before the warm-up: a disabled capture runs nothing
        raise CaptureDisabledError("capture is disabled (set_capture_enabled(False))", key.descriptor)
    if warm:
        key.warm_up(engine, buffers)
    entry, captured = key.record(engine, device, start)
    layout.of(entry.output).check(entry.output, key.num_tokens, key.num_reqs)
    key.last_cut = None
    key.entry = entry  # last: the serving thread replays the key from its next step
    return captured


def agree_plan(
    ranks: RankAgreement | None, pending: Sequence[PlannedKey[OutputT]], no_graphs: str | None
) -> None:
    """With ``ranks``: every rank captures (or probes) the same keys, or all raise before any."""
    if ranks is not None:
        unable = no_graphs or (
            None if capture_enabled() else "capture is disabled (set_capture_enabled(False))"
        )
        ranks.agree_plan([(key.mode, key.descriptor) for key in pending], can_capture=unable)

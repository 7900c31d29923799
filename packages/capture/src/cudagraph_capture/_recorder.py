"""The recorder: one capture of a runnable for one batch descriptor, for both engines.

``GraphRecorder`` does what every capture does: the process-wide switch, the
device, stream and pool, the device's capture lock, the warm-ups, the error
that names the descriptor, the outputs held weakly. Its two kinds differ only
in how the work is recorded: one CUDA graph (``MonolithicRecorder``), or
graph segments split at eager breaks (``BreakableRecorder``). A recorder is a
``GraphEngine``: a runner that keeps the entries itself calls ``warm_up`` and
``record``; the wrappers (``_wrapper``) keep a table of its entries and follow
the forward context.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar, Final, Generic, TypeVar

import torch
from torch.utils import _pytree as pytree

from cudagraph_dispatch import FORWARD_CONTEXT_VAR, BatchDescriptor, CUDAGraphMode, set_forward_context

from ._breakable import BreakableCUDAGraphCapture
from ._device import require_cuda
from ._enabled import check_capture_enabled
from ._errors import CaptureError
from ._gc import collect_before_capture
from ._options import CaptureOptions
from ._pool import GraphPool, capture_lock, capture_stream, shared_pool
from ._protocols import RecordSeconds
from ._segment import (
    THREAD,
    abort_segment,
    begin_segment,
    end_segment,
    instantiate_segment,
    new_graph,
    on_side_stream,
)
from ._weakref import weak_ref_tensors

R = TypeVar("R")

_NO_EXTRA: Final[Mapping[str, object]] = MappingProxyType({})
#: What owns a captured graph: freeing it frees the graph (or the segments).
GraphOwner = torch.cuda.CUDAGraph | BreakableCUDAGraphCapture


@dataclasses.dataclass(frozen=True, slots=True)
class Recording(Generic[R]):
    """What one recording made: the graph's owner, its replay, its strong outputs, and what it did.

    ``executed``: the recording also ran the work (a breakable capture that
    executes its segments), so the outputs hold this call's results.
    ``recorded_work``: it recorded any device work or eager break at all.
    ``instantiation``: host seconds building the executables.
    """

    owner: GraphOwner
    replay: Callable[[], object]
    output: R
    executed: bool
    recorded_work: bool
    instantiation: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """One recording's inputs: the key, where it records, the runnable's arguments, whether it executes."""

    descriptor: BatchDescriptor
    pool: GraphPool
    stream: torch.cuda.Stream
    args: tuple[object, ...]
    kwargs: dict[str, object]
    execute: bool


class Entry(Generic[R]):
    """One captured graph: how to replay it, what it returns, what it expects (a ``GraphEntry``)."""

    __slots__ = ("addresses", "output", "owner", "replay", "seconds")

    def __init__(
        self,
        owner: GraphOwner,
        replay: Callable[[], object],
        output: R,
        addresses: tuple[tuple[str, int], ...] | None,
        seconds: RecordSeconds,
    ) -> None:
        self.owner: Final = owner  # owns the graph(s): freed with the entry
        self.replay: Final = replay
        self.output: Final = output
        self.addresses: Final = addresses  # (argument path, data pointer), with check_input_addresses
        self.seconds: Final = seconds  # what the recording cost the host


def _callers_extra() -> Mapping[str, object]:
    """The extras of the caller's forward context (attention metadata, say), carried into the runnable's."""
    context = FORWARD_CONTEXT_VAR.get()
    return _NO_EXTRA if context is None else context.extra


class GraphRecorder(Generic[R]):
    """Captures ``runnable`` under the forward-context mode ``mode``, with ``options``.

    ``name`` is what errors call the engine (its wrapper's class name).
    """

    __slots__ = ("mode", "name", "options", "runnable")

    #: Why a recording that recorded nothing is refused (replaying nothing would
    #: hand back the capture's outputs forever).
    NO_WORK: ClassVar[str] = "the capture recorded no CUDA work (does the runnable run on the CPU?)"

    def __init__(
        self, runnable: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions, name: str
    ) -> None:
        self.name: Final = name
        self.runnable: Final = runnable
        self.mode: Final = mode
        self.options: Final = options

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        """``options.warmup_runs`` eager runs on the capture stream (``GraphEngine.warm_up``)."""
        require_cuda(self.name)
        if self.options.warmup_runs:
            device = torch.cuda.current_device()
            with capture_lock(device):
                self._warm_up(descriptor, self._stream(device), (), dict(inputs), _callers_extra())

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> Entry[R]:
        """Capture without running anything on the device; the caller owns the entry (``GraphEngine``)."""
        with set_forward_context(self.mode, descriptor, **_callers_extra()):
            entry, _ = self.capture(descriptor, (), dict(inputs), execute=False)
        return entry

    def capture(
        self,
        descriptor: BatchDescriptor,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        *,
        execute: bool,
        extra: Mapping[str, object] = _NO_EXTRA,
    ) -> tuple[Entry[R], R]:
        """The entry of a new capture and its strong outputs (under the caller's forward context).

        ``execute``: warm up first (under ``(NONE, descriptor, **extra)``, the
        extras of the caller's context) and run the captured work, so the
        outputs hold this call's results; else only record. ``CaptureError``
        names ``descriptor``; the failed graph is freed before it is raised.
        """
        device, pool = self._ready(descriptor)
        try:
            with capture_lock(device):  # another thread's capture on this device waits for this one
                stream = self._stream(device)
                if execute and self.options.warmup_runs:
                    self._warm_up(descriptor, stream, args, kwargs, extra)
                recording, recorded_s = self._recorded(_Call(descriptor, pool, stream, args, kwargs, execute))
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(
                f"{self.name}: capture failed with {type(error).__name__}: {error}", descriptor
            ) from error
        except BaseException as error:  # KeyboardInterrupt, SystemExit: never wrapped, but say where
            if sys.version_info >= (3, 11):
                error.add_note(f"{self.name}: interrupted while capturing the graph of {descriptor}")
            raise
        if execute and not recording.executed:
            # The capture only recorded the work: run it once so that this
            # call's outputs hold the result for this call's inputs.
            recording.replay()
        addresses = addresses_of(args, kwargs) if self.options.check_input_addresses else None
        output = recording.output
        kept = weak_ref_tensors(output) if self.options.weak_ref_output else output
        seconds = RecordSeconds(recorded_s - recording.instantiation, recording.instantiation)
        return Entry(recording.owner, recording.replay, kept, addresses, seconds), output

    def _ready(self, descriptor: BatchDescriptor) -> tuple[int, GraphPool]:
        """The device and pool a capture of ``descriptor`` records into, or ``CaptureError`` why not."""
        check_capture_enabled(descriptor)
        try:
            require_cuda(self.name)
        except RuntimeError as error:
            raise CaptureError(str(error), descriptor) from None
        if THREAD.breakable is not None:
            raise CaptureError(f"{self.name}: cannot capture inside an active breakable capture", descriptor)
        device = torch.cuda.current_device()
        return device, shared_pool(device) if self.options.pool is None else self.options.pool

    def _recorded(self, call: _Call) -> tuple[Recording[R], float]:
        """``_record(call)`` and its host seconds; ``CaptureError`` where it recorded no work."""
        start = time.perf_counter()
        recording: Recording[R] | None = self._record(call)
        recorded_s = time.perf_counter() - start
        assert recording is not None
        if not recording.recorded_work:
            # Freed now, under the capture lock, not whenever the traceback goes: torch's
            # generator keeps a registry of live graphs that another thread's capture writes.
            recording = None
            raise CaptureError(self.NO_WORK, call.descriptor)
        return recording, recorded_s

    def _stream(self, device: int) -> torch.cuda.Stream:
        return capture_stream(device) if self.options.stream is None else self.options.stream

    def _warm_up(
        self,
        descriptor: BatchDescriptor,
        stream: torch.cuda.Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        extra: Mapping[str, object],
    ) -> None:
        """Run the runnable eagerly on the capture stream, as NONE (nested wrappers pass through)."""
        with on_side_stream(stream):
            for _ in range(self.options.warmup_runs):  # a context per run: a forward's own
                with set_forward_context(CUDAGraphMode.NONE, descriptor, **extra):
                    self.runnable(*args, **kwargs)

    def _record(self, call: _Call) -> Recording[R]:
        """Record the runnable's work (``call.execute=False``: a breakable capture runs nothing)."""
        raise NotImplementedError


class MonolithicRecorder(GraphRecorder[R]):
    """One CUDA graph per descriptor (``CUDAGraphWrapper``)."""

    __slots__ = ()

    def _record(self, call: _Call) -> Recording[R]:
        graph: torch.cuda.CUDAGraph | None = new_graph()
        assert graph is not None
        collect_before_capture(self.options.gc_disable)
        try:
            with on_side_stream(call.stream):
                begin_segment(graph, call.pool)
                try:
                    output = self.runnable(*call.args, **call.kwargs)
                except BaseException:
                    abort_segment(graph, call.pool)
                    raise
                recorded_work = end_segment(graph, call.pool, call.descriptor)
            instantiation = instantiate_segment(graph) if recorded_work else 0.0
        except BaseException:
            graph = None  # freed now, under the capture lock (see GraphRecorder.capture)
            raise
        return Recording(graph, graph.replay, output, False, recorded_work, instantiation)


class BreakableRecorder(GraphRecorder[R]):
    """Graph segments split at eager breaks, replayed in order with the breaks run between them."""

    __slots__ = ()

    NO_WORK: ClassVar[str] = (
        "the capture recorded no CUDA work and no eager break (does the runnable run on the CPU?)"
    )

    def _record(self, call: _Call) -> Recording[R]:
        capture = BreakableCUDAGraphCapture(
            call.pool,
            stream=call.stream,
            gc_disable=self.options.gc_disable,
            descriptor=call.descriptor,
            execute=call.execute,
        )
        with capture:
            output = self.runnable(*call.args, **call.kwargs)
        recorded_work = capture.num_graphs > 0 or capture.num_eager_breaks > 0
        instantiation = capture.instantiation_seconds
        # executed = call.execute: an executing capture ran its segments as it recorded them.
        return Recording(capture, capture.replay, output, call.execute, recorded_work, instantiation)


def addresses_of(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[str, int], ...]:
    """``(argument path, data pointer)`` of every tensor argument, in call order."""
    found: list[tuple[str, int]] = []
    for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        for j, leaf in enumerate(pytree.tree_leaves(value)):
            if isinstance(leaf, torch.Tensor):
                found.append((name if leaf is value else f"{name}[leaf {j}]", leaf.data_ptr()))
    return tuple(found)

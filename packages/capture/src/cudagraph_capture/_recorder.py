"""The recorder: one capture of a runnable for one batch descriptor, for both engines.

``GraphRecorder`` does what every capture does (docs/design.md,
"Capture engines"); its two kinds differ only in how the work is recorded:
one CUDA graph (``MonolithicRecorder``), or graph segments split at eager
breaks (``BreakableRecorder``). A runner that keeps its entries itself takes a
recorder from ``graph_engine``; the wrappers (``_wrapper``) keep a table of
them. One capture makes one ``Entry``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar, Final, Generic, TypeVar

import torch
from torch.cuda import Stream
from torch.utils import _pytree as pytree

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from cudagraph_dispatch._context import FORWARD_CONTEXT_VAR  # the variable itself: a hot path reads it

from ._breakable import BreakableCUDAGraphCapture
from ._device import require_cuda
from ._enabled import check_capture_enabled
from ._errors import CaptureError, capture_failure, invalidated_capture, note_interrupt
from ._gc import collect_before_capture
from ._options import CaptureOptions
from ._pool import GraphPool, capture_lock, capture_stream, shared_pool
from ._protocols import GraphEngine, RecordSeconds
from ._segment import (
    THREAD,
    abort_segment,
    begin_segment,
    end_segment,
    instantiate_segment,
    new_graph,
    on_side_stream,
)
from ._weakref import weak_ref_tree

R = TypeVar("R")

_NO_EXTRA: Final[Mapping[str, object]] = MappingProxyType({})
#: What owns a captured graph: freeing it frees the graph (or the segments).
GraphOwner = torch.cuda.CUDAGraph | BreakableCUDAGraphCapture


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Entry(Generic[R]):
    """One captured graph: how to replay it, what it returns, what it expects (a ``GraphEntry``).

    ``owner`` owns the graph (or the segments): dropping the entry frees it.
    ``replay`` is ``owner.replay``, bound once (the hot path calls it).
    ``addresses``: ``(argument path, data pointer)`` of the tensor arguments,
    with ``check_input_addresses``, else ``None``.
    """

    owner: GraphOwner
    replay: Callable[[], object]
    output: R
    addresses: tuple[tuple[str, int], ...] | None
    seconds: RecordSeconds


def check_descriptor(descriptor: object) -> None:
    """``ValueError`` unless ``descriptor`` is a ``BatchDescriptor``."""
    if descriptor.__class__ is not BatchDescriptor:
        raise ValueError(f"descriptor: expected a BatchDescriptor, got {descriptor!r}")


def check_inputs(inputs: object) -> None:
    """``inputs`` of ``warm_up``/``record``: a mapping of keyword names to tensors, else ``ValueError``.

    Checked before anything asks for CUDA, so a bad argument is named as such on any machine.
    """
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs: expected a mapping of keyword names to tensors, got {inputs!r:.80}")
    for name, value in inputs.items():
        if not isinstance(name, str):
            raise ValueError(f"inputs: expected keyword names (str), got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"inputs[{name!r}]: expected a torch.Tensor, got {type(value).__name__}")


def _callers_extra() -> Mapping[str, object]:
    """The extras of the caller's forward context (attention metadata, say), carried into the runnable's."""
    context = FORWARD_CONTEXT_VAR.get()
    return _NO_EXTRA if context is None else context.extra


class GraphRecorder(Generic[R]):
    """Captures ``runnable`` under the forward-context mode ``mode``, with ``options``.

    ``options=None``: the defaults. ``name`` is what errors call the engine.
    A ``runnable`` that is not callable, or ``options`` that are not
    ``CaptureOptions``, raise ``ValueError`` naming them.
    """

    __slots__ = ("mode", "name", "options", "runnable")

    #: Why a recording that recorded nothing is refused (replaying nothing would
    #: hand back the capture's outputs forever).
    NO_WORK: ClassVar[str] = "the capture recorded no CUDA work (does the runnable run on the CPU?)"
    #: Whether a capture asked to execute runs the work as it records it; else
    #: ``capture`` replays the recording once, so the outputs hold the call's results.
    EXECUTES: ClassVar[bool] = False

    def __init__(
        self, runnable: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions | None, name: str
    ) -> None:
        given: object = runnable  # checked at run time: callers may not be typed
        if not callable(given):
            raise ValueError(f"runnable: expected a callable, got {given!r}")
        if isinstance(given, type):
            raise ValueError(
                f"runnable: expected the callable to capture (an instance or a function), got the class "
                f"{given.__name__}; pass an instance ({given.__name__}(...))"
            )
        self.name: Final = name
        self.runnable: Final = runnable
        self.mode: Final = mode
        self.options: Final = CaptureOptions.given(options)

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        """``options.warmup_runs`` eager runs on the capture stream (``GraphEngine.warm_up``).

        A bad argument raises ``ValueError`` naming it before anything asks for CUDA.
        """
        check_descriptor(descriptor)
        check_inputs(inputs)
        require_cuda(self.name)
        if self.options.warmup_runs:
            device = torch.cuda.current_device()
            with capture_lock(device):
                self._warm_up(descriptor, self._stream(device), (), dict(inputs), _callers_extra())

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> Entry[R]:
        """Capture without running anything on the device; the caller owns the entry (``GraphEngine``).

        A bad argument raises ``ValueError`` naming it before anything asks for CUDA.
        """
        check_descriptor(descriptor)
        check_inputs(inputs)
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
                run = functools.partial(self.runnable, *args, **kwargs)
                start = time.perf_counter()
                owner, output, instantiation = self._record(run, descriptor, pool, stream, execute)
                recorded_s = time.perf_counter() - start
        except CaptureError:
            raise
        except Exception as error:
            raise capture_failure(self.name, error, descriptor) from error
        except BaseException as error:  # KeyboardInterrupt, SystemExit: never wrapped, but say where
            note_interrupt(error, self.name, "the graph", descriptor)
            raise
        if execute and not self.EXECUTES:
            owner.replay()
        addresses = addresses_of(args, kwargs) if self.options.check_input_addresses else None
        kept = weak_ref_tree(output) if self.options.weak_ref_output else output
        seconds = RecordSeconds(max(recorded_s - instantiation, 0.0), instantiation)
        return Entry(owner, owner.replay, kept, addresses, seconds), output

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

    def _stream(self, device: int) -> Stream:
        return capture_stream(device) if self.options.stream is None else self.options.stream

    def _warm_up(
        self,
        descriptor: BatchDescriptor,
        stream: Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        extra: Mapping[str, object],
    ) -> None:
        """Run the runnable eagerly on the capture stream, as NONE (nested wrappers pass through)."""
        with on_side_stream(stream):
            for _ in range(self.options.warmup_runs):  # a context per run: a forward's own
                with set_forward_context(CUDAGraphMode.NONE, descriptor, **extra):
                    self.runnable(*args, **kwargs)

    def _record(
        self, run: Callable[[], R], key: BatchDescriptor, pool: GraphPool, stream: Stream, execute: bool
    ) -> tuple[GraphOwner, R, float]:
        """Record ``run()`` (the runnable's call) for ``key`` into ``pool`` on ``stream``.

        Returns the graph's owner, its strong outputs and the seconds spent
        instantiating it. ``execute=False``: a breakable capture runs nothing.
        A recording of no work raises ``CaptureError(NO_WORK)``. A failed
        recording frees its graph before raising, under the capture lock, not
        whenever the traceback goes: torch's generator keeps a registry of
        live graphs that another thread's capture writes.
        """
        raise NotImplementedError


class MonolithicRecorder(GraphRecorder[R]):
    """One CUDA graph per descriptor (``CUDAGraphWrapper``, ``graph_engine`` for FULL)."""

    __slots__ = ()

    def _record(
        self, run: Callable[[], R], key: BatchDescriptor, pool: GraphPool, stream: Stream, execute: bool
    ) -> tuple[GraphOwner, R, float]:
        graph: torch.cuda.CUDAGraph | None = new_graph()
        assert graph is not None
        collect_before_capture(self.options.gc_disable)
        try:
            with on_side_stream(stream):
                begin_segment(graph, pool)
                try:
                    output = run()
                except Exception as error:
                    if abort_segment(graph, pool):
                        raise invalidated_capture(self.name, error, key) from error
                    raise
                except BaseException:
                    abort_segment(graph, pool)
                    raise
                recorded_work = end_segment(graph, pool, key)
            if not recorded_work:
                raise CaptureError(self.NO_WORK, key)
            return graph, output, instantiate_segment(graph)
        except BaseException:
            graph = None  # freed now (see GraphRecorder._record)
            raise


class BreakableRecorder(GraphRecorder[R]):
    """Graph segments split at eager breaks, replayed in order with the breaks run between them."""

    __slots__ = ()

    NO_WORK: ClassVar[str] = (
        "the capture recorded no CUDA work and no eager break (does the runnable run on the CPU?)"
    )
    EXECUTES: ClassVar[bool] = True  # an executing capture runs its segments as it records them

    def _record(
        self, run: Callable[[], R], key: BatchDescriptor, pool: GraphPool, stream: Stream, execute: bool
    ) -> tuple[GraphOwner, R, float]:
        capture = BreakableCUDAGraphCapture(
            pool, stream=stream, gc_disable=self.options.gc_disable, descriptor=key, execute=execute
        )
        with capture:
            output = run()
        if capture.num_graphs == 0 and capture.num_eager_breaks == 0:
            del capture  # freed now (see GraphRecorder._record)
            raise CaptureError(self.NO_WORK, key)
        return capture, output, capture.instantiation_seconds


def graph_engine(
    runnable: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions | None = None
) -> GraphEngine[R]:
    """The engine of ``mode`` for a runner that keeps its entries itself (a ``GraphEngine``).

    ``record`` calls ``runnable(**inputs)`` under the forward context
    ``(mode, descriptor)`` and hands back a new entry that the caller owns:
    the engine keeps nothing. The signature is a ``GraphEngineFactory``'s
    (``cudagraph_manager``'s default).

    Args:
        runnable: the model: an instance or a function taking the static
            inputs as keywords (a class is refused).
        mode: FULL (one CUDA graph per key) or PIECEWISE (graph segments
            split at ``eager_break_during_capture`` ops).
        options: the capture options (``None``: the defaults).

    Returns:
        The engine.

    Raises:
        ValueError: another mode, a ``runnable`` that is not callable, or
            ``options`` that are not ``CaptureOptions``, naming them.
    """
    if mode is CUDAGraphMode.FULL:
        return MonolithicRecorder(runnable, mode, options, "graph_engine(FULL)")
    if mode is CUDAGraphMode.PIECEWISE:
        return BreakableRecorder(runnable, mode, options, "graph_engine(PIECEWISE)")
    raise ValueError(f"mode: expected FULL or PIECEWISE, got {mode!r}")


def addresses_of(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[str, int], ...]:
    """``(argument path, data pointer)`` of every tensor argument, in call order."""
    found: list[tuple[str, int]] = []
    for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        for j, leaf in enumerate(pytree.tree_leaves(value)):
            if isinstance(leaf, torch.Tensor):
                found.append((name if leaf is value else f"{name}[leaf {j}]", leaf.data_ptr()))
    return tuple(found)

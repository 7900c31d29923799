"""The breakable engine: a forward captured as graph segments split by eager ops.

Ops that cannot be captured (attention with host-side metadata, KV transfer)
are decorated with ``eager_break_during_capture``. Inside a breakable capture
a call to one ends the current graph segment, runs the op eagerly on the
capture stream, records it, and starts a new segment. Replay runs the
recorded steps in order on the caller's stream: graph, op, graph, ...
A capture replays each segment as soon as it is recorded; ``execute=False``
records only, running nothing (docs/design.md, "Capture engines", says why).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Final, ParamSpec, TypeVar

import torch

from cudagraph_dispatch import BatchDescriptor
from cudagraph_dispatch.lowlevel import check_bool

from ._device import require_cuda
from ._enabled import check_capture_enabled
from ._errors import CaptureError, invalidated_capture
from ._gc import collect_before_capture
from ._pool import GraphPool, capture_stream, check_pool, check_stream, shared_pool
from ._segment import THREAD, abort_segment, begin_segment, end_segment, instantiate_segment, new_graph
from ._weakref import contains_cuda_tensor, weak_ref_tree

P = ParamSpec("P")
R = TypeVar("R")

_Step = Callable[[], object]


class BreakableCUDAGraphCapture:
    """Captures one forward as graph segments split by eager breaks.

    Usage::

        capture = BreakableCUDAGraphCapture(pool)
        with capture:
            out = model(**static_inputs)   # eager breaks split it
        ...                                # copy new data into static_inputs
        capture.replay()                   # out is rewritten in place

    One capture may be active per thread (``current()``); nesting raises
    ``RuntimeError``. All segments share one pool and one capture stream. An
    exception in the body ends the capture, discards its segments and clears
    the thread's active capture; where CUDA had invalidated the capture, a
    ``CaptureInvalidatedError`` is raised from it. Segments that captured no
    work are dropped.

    Args:
        pool: the graph pool of the segments (``None``: the device's shared
            pool), a handle torch made in this process.
        stream: the capture stream (``None``: the device's, ordered after the
            caller's stream).
        gc_disable: never collect garbage at the capture (see the README,
            "Garbage collection during captures").
        descriptor: the key being captured, named by its errors.
        execute: run each segment and eager break as it is recorded;
            ``False`` records only (nothing runs, no break is called).

    Raises:
        ValueError: a bad argument, naming it.
    """

    __slots__ = (
        "_caller",
        "_descriptor",
        "_execute",
        "_gc_disable",
        "_graph",
        "_graphs",
        "_in_eager",
        "_instantiation",
        "_num_breaks",
        "_pool",
        "_state",
        "_steps",
        "_stream",
        "_stream_ctx",
        "_tail",
    )

    def __init__(
        self,
        pool: GraphPool | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        gc_disable: bool = True,
        descriptor: BatchDescriptor | None = None,
        execute: bool = True,
    ) -> None:
        check_pool("pool", pool)
        check_stream("stream", stream)
        if descriptor is not None and descriptor.__class__ is not BatchDescriptor:
            raise ValueError(f"descriptor: expected None or a BatchDescriptor, got {descriptor!r}")
        self._pool = pool
        self._stream = stream
        self._gc_disable: Final = check_bool("gc_disable", gc_disable)
        self._execute: Final = check_bool("execute", execute)
        self._descriptor: Final = descriptor
        self._graphs: list[torch.cuda.CUDAGraph] = []
        # What replay() runs: until a capture succeeds, one step that refuses (replay pays no check).
        self._steps: tuple[_Step, ...] = (_not_captured,)
        self._tail: list[_Step] = []  # steps recorded while capturing
        self._graph: torch.cuda.CUDAGraph | None = None  # the open segment
        self._caller: torch.cuda.Stream | None = None
        self._stream_ctx: torch.cuda.StreamContext | None = None
        self._num_breaks = 0
        self._instantiation = 0.0  # host seconds building the segments' executables
        self._in_eager = False
        self._state = "new"  # -> "capturing" -> "captured" | "failed"

    @staticmethod
    def current() -> BreakableCUDAGraphCapture | None:
        """The capture active in this thread, or ``None``."""
        active = THREAD.breakable
        return active if isinstance(active, BreakableCUDAGraphCapture) else None

    @property
    def num_graphs(self) -> int:
        """Graph segments captured (empty segments are not kept)."""
        return len(self._graphs)

    @property
    def num_eager_breaks(self) -> int:
        """Eager ops recorded between segments."""
        return self._num_breaks

    @property
    def instantiation_seconds(self) -> float:
        """Host seconds spent building the segments' executables (``cudaGraphInstantiate``)."""
        return self._instantiation

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if THREAD.breakable is not None:
            raise RuntimeError("BreakableCUDAGraphCapture: a capture is already active in this thread")
        if self._state != "new":
            raise RuntimeError(f"BreakableCUDAGraphCapture: can be entered once (state: {self._state})")
        check_capture_enabled(self._descriptor)
        try:
            require_cuda("BreakableCUDAGraphCapture")
        except RuntimeError as error:
            raise CaptureError(str(error), self._descriptor) from None
        device = torch.cuda.current_device()
        self._pool = shared_pool(device) if self._pool is None else self._pool
        stream = capture_stream(device) if self._stream is None else self._stream
        self._stream = stream
        caller = torch.cuda.current_stream(device)
        self._caller = caller
        collect_before_capture(self._gc_disable)
        stream.wait_stream(caller)
        self._stream_ctx = torch.cuda.stream(stream)
        self._stream_ctx.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        self._state = "capturing"
        THREAD.breakable = self
        try:
            self._begin()
        except BaseException:
            self._finish(failed=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failed = exc_type is not None
        try:
            if self._graph is not None:
                if failed:
                    assert self._pool is not None
                    invalidated = abort_segment(self._graph, self._pool)
                    self._graph = None
                    if invalidated and isinstance(exc, Exception):  # the same capture may succeed again
                        raise invalidated_capture("BreakableCUDAGraphCapture", exc, self._descriptor) from exc
                else:
                    self._end()
        except BaseException:
            failed = True
            raise
        finally:
            self._finish(failed=failed)

    def add_eager(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """End the segment, run ``fn`` eagerly, record it for replay, start a new segment.

        ``fn`` must write its results into buffers it was given: its tensor
        arguments are recorded as non-owning aliases (they must not pin pool
        memory).

        Args:
            fn: the eager break.
            *args: its arguments, as the replay passes them too.
            **kwargs: its keyword arguments.

        Returns:
            What ``fn`` returned; ``None`` in a record-only capture
            (``execute=False``), which does not call ``fn`` now.

        Raises:
            RuntimeError: this capture is not active in this thread.
            CaptureError: ``fn`` returned a CUDA tensor (its return value is
                not replayed).
        """
        if THREAD.breakable is not self or self._graph is None:
            raise RuntimeError("add_eager: this capture is not active in this thread")
        self._end()
        recorded = functools.partial(fn, *weak_ref_tree(args), **weak_ref_tree(kwargs))
        if not self._execute:
            self._tail.append(recorded)
            self._num_breaks += 1
            self._begin()
            return None  # type: ignore[return-value]  # record-only: fn is not called (documented)
        self._in_eager = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self._in_eager = False
        if contains_cuda_tensor(result):
            name = getattr(fn, "__qualname__", repr(fn))
            raise CaptureError(
                f"{name} returned a CUDA tensor during a breakable capture; an eager break must "
                "write its results into caller-provided buffers (its return value is not replayed)",
                self._descriptor,
            )
        self._tail.append(recorded)
        self._num_breaks += 1
        self._begin()
        return result

    def replay(self) -> None:
        """Run every segment and eager op in order on the current stream.

        Before a capture has completed (never entered, still capturing, or
        failed), ``RuntimeError`` says so: there is nothing to replay.
        """
        for step in self._steps:
            step()

    def _begin(self) -> None:
        graph = new_graph()
        assert self._pool is not None
        begin_segment(graph, self._pool)
        self._graph = graph

    def _end(self) -> None:
        graph, self._graph = self._graph, None
        assert graph is not None
        assert self._pool is not None
        if end_segment(graph, self._pool, self._descriptor):
            self._instantiation += instantiate_segment(graph)
            self._graphs.append(graph)
            step = graph.replay
            self._tail.append(step)
            if self._execute:
                step()  # run what was just recorded: the next eager op reads its results

    def _finish(self, *, failed: bool) -> None:
        """Leave the capture stream, order the caller after it, clear the thread state."""
        if self._stream_ctx is not None:
            self._stream_ctx.__exit__(None, None, None)
            self._stream_ctx = None
        if self._caller is not None and self._stream is not None:
            self._caller.wait_stream(self._stream)
        THREAD.breakable = None
        if failed:
            self._graphs.clear()
            self._tail.clear()
            self._num_breaks = 0
        self._state = "failed" if failed else "captured"
        self._steps = (_capture_failed,) if failed else tuple(self._tail)
        self._tail = []


# The one step of a capture with nothing to replay: module functions, so that
# the capture holds no reference cycle through its own steps.
def _not_captured() -> None:
    raise RuntimeError(
        "BreakableCUDAGraphCapture.replay(): nothing to replay, no capture has completed "
        "(capture first: `with capture: ...`, then replay)"
    )


def _capture_failed() -> None:
    raise RuntimeError(
        "BreakableCUDAGraphCapture.replay(): nothing to replay, the capture failed and its segments "
        "were discarded"
    )


def eager_break_during_capture(fn: Callable[P, R]) -> Callable[P, R]:
    """Make ``fn`` a break point of breakable captures; a plain call elsewhere.

    Inside a ``BreakableCUDAGraphCapture`` a call ends the graph segment, runs
    ``fn`` eagerly and records it for replay; nested decorated calls inside
    ``fn`` run plainly. Everywhere else, a FULL capture included (where ``fn``
    is then captured into the graph), it is an ordinary call. ``fn`` must
    write into caller-provided buffers and return no CUDA tensor.

    Args:
        fn: a function (a class is refused: a break writes into buffers it
            is given, it makes no object).

    Returns:
        ``fn`` wrapped, with its signature.

    Raises:
        ValueError: ``fn`` is not callable, or is a class.
    """
    given: object = fn  # checked at run time: callers may not be typed
    if not callable(given):
        raise ValueError(f"fn: expected a callable to make a break point, got {given!r}")
    if isinstance(given, type):  # calling it makes an object: a break writes into buffers it is given
        raise ValueError(f"fn: expected a function to make a break point, got the class {given.__name__}")

    @functools.wraps(fn)
    def breakable(*args: P.args, **kwargs: P.kwargs) -> R:
        active = THREAD.breakable
        if active is None or not isinstance(active, BreakableCUDAGraphCapture) or active._in_eager:
            return fn(*args, **kwargs)
        return active.add_eager(fn, *args, **kwargs)

    return breakable

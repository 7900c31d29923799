"""Graph wrappers: capture once per batch descriptor, replay afterwards.

Two ways in, one table of captured graphs:

- As a model layer (vLLM's contract): a call reads the forward context
  (``cudagraph_dispatch``). With no context, NONE, or a mode the wrapper does
  not serve, it calls its runnable; otherwise it captures on the first call
  for the context's descriptor and replays that graph on every later call.
- Directly: ``capture(descriptor, ...)``, ``is_captured(descriptor)`` and
  ``replay(descriptor)``, with no forward context to set and read back on
  every step.

A model runner that keeps its graphs itself (``cudagraph_manager``) uses the
``GraphEngine`` seam instead: ``warm_up`` runs the model eagerly, ``record``
captures without running anything and hands back the entry, which the
runner owns and replays; the wrapper's table is not involved.

A wrapper keeps no input buffers: the caller keeps its inputs at fixed
addresses and copies new data into them before each replay.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Final, Generic, ParamSpec, TypeVar

import torch
from torch.utils import _pytree as pytree

from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    set_forward_context,
)

from ._breakable import BreakableCUDAGraphCapture
from ._device import require_cuda
from ._enabled import check_capture_enabled
from ._errors import CaptureError
from ._gc import collect_before_capture
from ._options import CaptureOptions
from ._pool import GraphPool, capture_lock, capture_stream, shared_pool
from ._segment import THREAD, abort_segment, begin_segment, end_segment, on_side_stream
from ._weakref import weak_ref_tensors

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_OPTIONS: Final = CaptureOptions()
_OWN: Final = frozenset({"_runnable", "_options", "_entries", "_capture_mode", "_other_mode"})


class _Entry(Generic[R]):
    """One captured graph: how to replay it, what it returns, what it expects (a ``GraphEntry``)."""

    __slots__ = ("addresses", "engine", "output", "replay")

    def __init__(
        self,
        engine: object,
        replay: Callable[[], object],
        output: R,
        addresses: tuple[tuple[str, int], ...] | None,
    ) -> None:
        self.engine: Final = engine  # owns the graph(s): freed with the entry
        self.replay: Final = replay
        self.output: Final = output
        self.addresses: Final = addresses


class _GraphWrapper(Generic[P, R]):
    """What both wrappers share: the dispatch contract, entries, errors."""

    __slots__ = ("__weakref__", "_capture_mode", "_entries", "_options", "_other_mode", "_runnable")

    def __init__(
        self,
        runnable: Callable[P, R],
        capture_mode: CUDAGraphMode,
        other_mode: CUDAGraphMode,
        options: CaptureOptions | None,
    ) -> None:
        if not callable(runnable):
            raise ValueError(f"runnable: expected a callable, got {runnable!r}")
        given: object = options
        if given is not None and not isinstance(given, CaptureOptions):
            raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
        self._runnable: Final = runnable
        self._options: Final = _DEFAULT_OPTIONS if options is None else options
        self._entries: Final[dict[BatchDescriptor, _Entry[R]]] = {}
        # The forward-context modes this wrapper captures and replays under; the
        # first is also the context an explicit capture() runs its runnable in.
        self._capture_mode: Final = capture_mode
        self._other_mode: Final = other_mode

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        context = FORWARD_CONTEXT_VAR.get()
        if context is None:
            return self._runnable(*args, **kwargs)
        mode = context.runtime_mode
        if mode is not self._capture_mode and mode is not self._other_mode:
            return self._runnable(*args, **kwargs)
        descriptor = context.batch_descriptor
        assert descriptor is not None  # set_forward_context requires one for graph modes
        entry = self._entries.get(descriptor)
        if entry is None:
            return self._capture_and_keep(context, descriptor, args, kwargs)
        if entry.addresses is not None:
            _check_addresses(descriptor, entry.addresses, args, kwargs)
        entry.replay()
        return entry.output

    def capture(self, descriptor: BatchDescriptor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Capture the graph of ``descriptor`` now, from a call of the runnable with these arguments.

        The runnable runs under the forward context ``(mode, descriptor)`` (the
        warm-up under NONE), as it would when called as a layer. Returns the
        capture's outputs, computed for these arguments. A descriptor that is
        already captured raises ``ValueError`` (``clear()`` first); a failed
        capture raises ``CaptureError`` and leaves the wrapper usable.
        """
        _check_descriptor(descriptor)
        if descriptor in self._entries:
            raise ValueError(f"descriptor: {descriptor} is already captured; clear() to capture it again")
        context = ForwardContext(self._capture_mode, descriptor)
        token = FORWARD_CONTEXT_VAR.set(context)
        try:
            return self._capture_and_keep(context, descriptor, args, kwargs)
        finally:
            FORWARD_CONTEXT_VAR.reset(token)

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        """``options.warmup_runs`` eager runs of the runnable on the capture stream (``GraphEngine``).

        Under the forward context ``(NONE, descriptor)``, ordered after the
        caller's stream and before its next work.
        """
        _check_descriptor(descriptor)
        require_cuda(type(self).__name__)
        if self._options.warmup_runs:
            device = torch.cuda.current_device()
            stream = capture_stream(device) if self._options.stream is None else self._options.stream
            with capture_lock(device):
                self._warm_up(ForwardContext(self._capture_mode, descriptor), stream, (), dict(inputs))

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> _Entry[R]:
        """Capture ``descriptor``'s graph without running anything on the device (``GraphEngine``).

        The runnable is called once with ``inputs`` as keywords under the
        forward context ``(mode, descriptor)``; its work is recorded, not
        executed, and the entry is returned, not kept: the caller owns it.
        ``CaptureError`` names the descriptor on failure.
        """
        _check_descriptor(descriptor)
        context = ForwardContext(self._capture_mode, descriptor)
        token = FORWARD_CONTEXT_VAR.set(context)
        try:
            entry, _ = self._capture(context, descriptor, (), dict(inputs), execute=False)
        finally:
            FORWARD_CONTEXT_VAR.reset(token)
        return entry

    def discard(self, descriptor: BatchDescriptor, /) -> None:
        """Free the graph of ``descriptor``, if it has one (its caller rejected what it captured)."""
        self._entries.pop(descriptor, None)

    def is_captured(self, descriptor: BatchDescriptor, /) -> bool:
        """Whether ``descriptor`` has a captured graph: this table is the one place that knows."""
        return descriptor in self._entries

    def replay(self, descriptor: BatchDescriptor, /) -> R:
        """Replay the graph of ``descriptor`` on the current stream; return its outputs.

        The outputs are the objects the capture returned (aliases of graph
        memory, rewritten by every replay). No host synchronization. A
        descriptor that was never captured raises ``KeyError``.
        """
        try:
            entry = self._entries[descriptor]
        except KeyError:
            raise KeyError(f"{type(self).__name__}: no graph captured for {descriptor}") from None
        entry.replay()
        return entry.output

    def unwrap(self) -> Callable[P, R]:
        """The wrapped runnable."""
        return self._runnable

    @property
    def options(self) -> CaptureOptions:
        return self._options

    @property
    def num_captured(self) -> int:
        """How many descriptors have a captured graph."""
        return len(self._entries)

    def clear(self) -> None:
        """Free every captured graph; the shared pool stays usable for new captures."""
        self._entries.clear()

    def __getattr__(self, name: str) -> object:
        # Only reached for names not found on the wrapper: fall through to the runnable.
        if name in _OWN or name.startswith("__"):
            raise AttributeError(name)
        runnable = self._runnable
        try:
            return getattr(runnable, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}, and neither has its runnable {runnable!r}"
            ) from None

    def _capture_and_keep(
        self,
        context: ForwardContext,
        descriptor: BatchDescriptor,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> R:
        """Warm up, capture and run: keep the entry, return the outputs computed for these arguments."""
        entry, output = self._capture(context, descriptor, args, kwargs, execute=True)
        self._entries[descriptor] = entry
        # The strong output goes back to the caller: while it holds it, later
        # captures into the pool cannot reuse its memory (it may feed them).
        return output

    def _capture(
        self,
        context: ForwardContext,
        descriptor: BatchDescriptor,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        *,
        execute: bool,
    ) -> tuple[_Entry[R], R]:
        """The entry of a new capture and its strong outputs.

        ``execute``: warm up first and run the captured work, so the outputs
        hold this call's results; else only record (see ``record``).
        """
        check_capture_enabled(descriptor)
        try:
            require_cuda(type(self).__name__)
        except RuntimeError as error:
            raise CaptureError(str(error), descriptor) from None
        if THREAD.breakable is not None:
            raise CaptureError(
                f"{type(self).__name__}: cannot capture inside an active breakable capture", descriptor
            )
        options = self._options
        device = torch.cuda.current_device()
        pool = shared_pool(device) if options.pool is None else options.pool
        stream = capture_stream(device) if options.stream is None else options.stream
        try:
            with capture_lock(device):  # another thread's capture on this device waits for this one
                if execute and options.warmup_runs:
                    self._warm_up(context, stream, args, kwargs)
                engine, replay, output, ran = self._capture_engine(
                    descriptor, pool, stream, args, kwargs, execute
                )
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(
                f"{type(self).__name__}: capture failed with {type(error).__name__}: {error}", descriptor
            ) from error
        except BaseException as error:  # KeyboardInterrupt, SystemExit: never wrapped, but say where
            if sys.version_info >= (3, 11):
                error.add_note(
                    f"{type(self).__name__}: interrupted while capturing the graph of {descriptor}"
                )
            raise
        if execute and not ran:
            # The capture only recorded the work: run it once so that this
            # call's outputs hold the result for this call's inputs.
            replay()
        addresses = _addresses(args, kwargs) if options.check_input_addresses else None
        kept = weak_ref_tensors(output) if options.weak_ref_output else output
        return _Entry(engine, replay, kept, addresses), output

    def _warm_up(
        self,
        context: ForwardContext,
        stream: torch.cuda.Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> None:
        """Run the runnable eagerly on the capture stream, as NONE (nested wrappers pass through)."""
        with (
            on_side_stream(stream),
            set_forward_context(CUDAGraphMode.NONE, context.batch_descriptor, **context.extra),
        ):
            for _ in range(self._options.warmup_runs):
                self._runnable(*args, **kwargs)  # type: ignore[arg-type]  # args come from the caller's P

    def _capture_engine(
        self,
        descriptor: BatchDescriptor,
        pool: GraphPool,
        stream: torch.cuda.Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        execute: bool,
    ) -> tuple[object, Callable[[], object], R, bool]:
        """Capture; returns (owner, replay, output, whether the capture already ran the work).

        ``execute=False``: record only (a breakable capture runs no segment and no eager break).
        """
        raise NotImplementedError


class CUDAGraphWrapper(_GraphWrapper[P, R]):
    """The monolithic engine: one CUDA graph per batch descriptor.

    ``runtime_mode`` (FULL or PIECEWISE) is the forward-context mode this
    wrapper serves; under any other mode it is a plain call, which lets an
    outer FULL wrapper and inner PIECEWISE wrappers nest. Replay returns the
    outputs captured for the descriptor, the same objects every time (treat
    them, and a list or dict holding them, as read-only); with
    ``weak_ref_output`` they stay valid until the next replay of any graph in
    the same pool.
    """

    __slots__ = ()

    def __init__(
        self,
        runnable: Callable[P, R],
        runtime_mode: CUDAGraphMode,
        options: CaptureOptions | None = None,
    ) -> None:
        if runtime_mode is not CUDAGraphMode.FULL and runtime_mode is not CUDAGraphMode.PIECEWISE:
            raise ValueError(f"runtime_mode: expected FULL or PIECEWISE, got {runtime_mode!r}")
        super().__init__(runnable, runtime_mode, runtime_mode, options)

    @property
    def runtime_mode(self) -> CUDAGraphMode:
        return self._capture_mode

    def _capture_engine(
        self,
        descriptor: BatchDescriptor,
        pool: GraphPool,
        stream: torch.cuda.Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        execute: bool,
    ) -> tuple[object, Callable[[], object], R, bool]:
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        assert graph is not None
        collect_before_capture(self._options.gc_disable)
        try:
            with on_side_stream(stream):
                begin_segment(graph, pool)
                try:
                    output = self._runnable(*args, **kwargs)  # type: ignore[arg-type]  # args come from the caller's P
                except BaseException:
                    abort_segment(graph, pool)
                    raise
                captured_work = end_segment(graph, pool, descriptor)
            if not captured_work:
                # Replaying nothing would hand back the capture's outputs forever: refuse.
                raise CaptureError(
                    "the capture recorded no CUDA work (does the runnable run on the CPU?)", descriptor
                )
        except BaseException:
            # Free the failed graph now, under the capture lock, not whenever the traceback goes:
            # torch's generator keeps a registry of live graphs that another thread's capture writes.
            graph = None
            raise
        return graph, graph.replay, output, False


class BreakableCUDAGraphWrapper(_GraphWrapper[P, R]):
    """The breakable engine behind the wrapper contract of ``CUDAGraphWrapper``.

    Captures with a ``BreakableCUDAGraphCapture`` under any forward-context
    mode other than NONE: graph segments split at ``eager_break_during_capture``
    ops, replayed in order with the ops run eagerly between them. An explicit
    ``capture()`` runs the runnable under a PIECEWISE context.
    """

    __slots__ = ()

    def __init__(self, runnable: Callable[P, R], options: CaptureOptions | None = None) -> None:
        super().__init__(runnable, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, options)

    def capture_for(self, descriptor: BatchDescriptor) -> BreakableCUDAGraphCapture | None:
        """The segments captured for ``descriptor`` (their counts), or ``None``."""
        entry = self._entries.get(descriptor)
        if entry is None:
            return None
        assert isinstance(entry.engine, BreakableCUDAGraphCapture)
        return entry.engine

    def _capture_engine(
        self,
        descriptor: BatchDescriptor,
        pool: GraphPool,
        stream: torch.cuda.Stream,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        execute: bool,
    ) -> tuple[object, Callable[[], object], R, bool]:
        capture = BreakableCUDAGraphCapture(
            pool, stream=stream, gc_disable=self._options.gc_disable, descriptor=descriptor, execute=execute
        )
        with capture:
            output = self._runnable(*args, **kwargs)  # type: ignore[arg-type]  # args come from the caller's P
        if capture.num_graphs == 0 and capture.num_eager_breaks == 0:
            raise CaptureError(
                "the capture recorded no CUDA work and no eager break (does the runnable run on the CPU?)",
                descriptor,
            )
        return capture, capture.replay, output, execute  # executed: segments ran as they were captured


def _check_descriptor(descriptor: object) -> None:
    if descriptor.__class__ is not BatchDescriptor:
        raise ValueError(f"descriptor: expected a BatchDescriptor, got {descriptor!r}")


def _addresses(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[str, int], ...]:
    """``(argument path, data pointer)`` of every tensor argument, in call order."""
    found: list[tuple[str, int]] = []
    for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        for j, leaf in enumerate(pytree.tree_leaves(value)):
            if isinstance(leaf, torch.Tensor):
                found.append((name if leaf is value else f"{name}[leaf {j}]", leaf.data_ptr()))
    return tuple(found)


def _check_addresses(
    descriptor: BatchDescriptor,
    expected: tuple[tuple[str, int], ...],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    """Raise ``ValueError`` naming the first tensor argument that moved since capture."""
    got = _addresses(args, kwargs)
    if got == expected:
        return
    # The lengths may differ: that case is reported after the loop.
    for (name, address), (got_name, got_address) in zip(expected, got, strict=False):
        if name != got_name or address != got_address:
            raise ValueError(
                f"{got_name}: tensor at address {got_address:#x}, but the graph for {descriptor} "
                f"was captured reading {name} at {address:#x}; copy new data into the captured tensor"
            )
    raise ValueError(
        f"tensor arguments: the graph for {descriptor} was captured with {len(expected)} tensor "
        f"arguments ({[n for n, _ in expected]}), got {len(got)} ({[n for n, _ in got]})"
    )

"""Graph wrappers: capture once per batch descriptor, replay afterwards.

Two ways in, one table of captured graphs:

- As a model layer (vLLM's contract): a call reads the forward context. With
  no context, NONE, or a mode the wrapper does not serve, it calls its
  runnable; otherwise the first call for a descriptor captures and later
  calls replay.
- Directly: ``capture(descriptor, ...)``, ``is_captured(descriptor)`` and
  ``replay(descriptor)``, with no forward context to set.

The recorder (``_recorder``) does the capture; a wrapper adds the table, and
passes ``warm_up`` and ``record`` (``GraphEngine``) to it. A wrapper keeps no
input buffers: the caller keeps its inputs at fixed addresses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Generic, ParamSpec, TypeVar

import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, ForwardContext
from cudagraph_dispatch._context import FORWARD_CONTEXT_VAR  # the variable itself: a hot path reads it

from ._breakable import BreakableCUDAGraphCapture
from ._options import CaptureOptions
from ._recorder import (
    BreakableRecorder,
    Entry,
    GraphRecorder,
    MonolithicRecorder,
    addresses_of,
    check_descriptor,
)

P = ParamSpec("P")
R = TypeVar("R")

_OWN: Final = frozenset({"_recorder", "_entries", "_other_mode"})


class _GraphWrapper(Generic[P, R]):
    """What both wrappers share: the forward-context contract and a table of entries, over a recorder."""

    __slots__ = ("__weakref__", "_entries", "_other_mode", "_recorder")

    def __init__(
        self,
        runnable: Callable[P, R],
        recorder: type[GraphRecorder[R]],
        capture_mode: CUDAGraphMode,
        other_mode: CUDAGraphMode,
        options: CaptureOptions | None,
    ) -> None:
        # The recorder's mode is the forward-context mode this wrapper captures and replays
        # under, and the context an explicit capture() runs its runnable in; the other mode
        # is served too. The recorder checks runnable and options.
        self._recorder: Final = recorder(runnable, capture_mode, options, type(self).__name__)
        self._other_mode: Final = other_mode
        self._entries: Final[dict[BatchDescriptor, Entry[R]]] = {}

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The runnable as a layer: by the forward context, a plain call, a capture or a replay.

        Args:
            *args: the runnable's arguments.
            **kwargs: the runnable's keyword arguments.

        Returns:
            The runnable's outputs: without a context, or under a mode this
            wrapper does not serve, those of a plain call; else those captured
            for the context's descriptor (the first call captures it).

        Raises:
            CaptureError: the capture failed (naming the descriptor); the
                wrapper stays usable.
            ValueError: with ``check_input_addresses``, a tensor argument at
                another address than the capture's.
        """
        context = FORWARD_CONTEXT_VAR.get()
        if context is None:
            return self._recorder.runnable(*args, **kwargs)
        mode = context.runtime_mode
        if mode is not self._recorder.mode and mode is not self._other_mode:
            return self._recorder.runnable(*args, **kwargs)
        descriptor = context.batch_descriptor
        assert descriptor is not None  # set_forward_context requires one for graph modes
        entry = self._entries.get(descriptor)
        if entry is None:
            return self._capture_and_keep(descriptor, args, kwargs, context.extra)
        if entry.addresses is not None:
            _check_addresses(descriptor, entry.addresses, args, kwargs)
        entry.replay()
        return entry.output

    def capture(self, descriptor: BatchDescriptor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Capture the graph of ``descriptor`` now, from a call of the runnable with these arguments.

        The runnable runs under the forward context ``(mode, descriptor)`` (the
        warm-up under NONE), as it would when called as a layer.

        Args:
            descriptor: the graph's key.
            *args: the runnable's arguments (the static inputs to capture).
            **kwargs: the runnable's keyword arguments.

        Returns:
            The capture's outputs, computed for these arguments.

        Raises:
            ValueError: ``descriptor`` is no ``BatchDescriptor``, or is
                captured already (``clear()`` first).
            CaptureError: the capture failed; the wrapper stays usable.
        """
        check_descriptor(descriptor)
        if descriptor in self._entries:
            raise ValueError(f"descriptor: {descriptor} is already captured; clear() to capture it again")
        token = FORWARD_CONTEXT_VAR.set(ForwardContext(self._recorder.mode, descriptor))
        try:
            return self._capture_and_keep(descriptor, args, kwargs, {})
        finally:
            FORWARD_CONTEXT_VAR.reset(token)

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        """``options.warmup_runs`` eager runs of the runnable on the capture stream (``GraphEngine``).

        Under the forward context ``(NONE, descriptor)``, ordered after the
        caller's stream and before its next work.

        Args:
            descriptor: the key about to be recorded.
            inputs: the runnable's keyword arguments (the static inputs).

        Raises:
            ValueError: a bad argument, naming it, before anything asks for
                CUDA.
            CaptureError: the runnable failed, or there is no CUDA device.
        """
        self._recorder.warm_up(descriptor, inputs)

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> Entry[R]:
        """Capture ``descriptor``'s graph without running anything on the device (``GraphEngine``).

        The runnable is called once with ``inputs`` as keywords under the
        forward context ``(mode, descriptor)``; its work is recorded, not
        executed.

        Args:
            descriptor: the graph's key.
            inputs: the runnable's keyword arguments (the static inputs).

        Returns:
            The entry, not kept here: the caller owns it (dropping it frees
            the graph).

        Raises:
            ValueError: a bad argument, naming it, before anything asks for
                CUDA.
            CaptureError: the capture failed, naming the descriptor.
        """
        return self._recorder.record(descriptor, inputs)

    def discard(self, descriptor: BatchDescriptor, /) -> None:
        """Free the graph of ``descriptor``, if it has one (its caller rejected what it captured).

        Args:
            descriptor: the graph's key.

        Raises:
            ValueError: ``descriptor`` is no ``BatchDescriptor``.
        """
        check_descriptor(descriptor)
        self._entries.pop(descriptor, None)

    def is_captured(self, descriptor: BatchDescriptor, /) -> bool:
        """Whether ``descriptor`` has a captured graph: this table is the one place that knows.

        Args:
            descriptor: the graph's key.

        Returns:
            True where a graph is captured for it.

        Raises:
            ValueError: ``descriptor`` is no ``BatchDescriptor`` (it could
                never be captured).
        """
        check_descriptor(descriptor)
        return descriptor in self._entries

    def replay(self, descriptor: BatchDescriptor, /) -> R:
        """Replay the graph of ``descriptor`` on the current stream; no host synchronization.

        Args:
            descriptor: the graph's key.

        Returns:
            The objects the capture returned (aliases of graph memory,
            rewritten by every replay).

        Raises:
            KeyError: no graph was captured for ``descriptor``.
            ValueError: ``descriptor`` is no ``BatchDescriptor`` (checked
                only when the look-up misses: a replay pays nothing for it).
        """
        try:
            entry = self._entries[descriptor]
        except (KeyError, TypeError):  # TypeError: an unhashable argument
            check_descriptor(descriptor)
            raise KeyError(f"{type(self).__name__}: no graph captured for {descriptor}") from None
        entry.replay()
        return entry.output

    def unwrap(self) -> Callable[P, R]:
        """The wrapped runnable."""
        return self._recorder.runnable

    @property
    def options(self) -> CaptureOptions:
        return self._recorder.options

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
        runnable = self._recorder.runnable
        try:
            return getattr(runnable, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}, and neither has its runnable {runnable!r}"
            ) from None

    def _capture_and_keep(
        self,
        descriptor: BatchDescriptor,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        extra: Mapping[str, object],
    ) -> R:
        """Warm up, capture and run: keep the entry, return the outputs computed for these arguments."""
        entry, output = self._recorder.capture(descriptor, args, kwargs, execute=True, extra=extra)
        self._entries[descriptor] = entry
        # The strong output goes back to the caller: while it holds it, later
        # captures into the pool cannot reuse its memory (it may feed them).
        return output


class CUDAGraphWrapper(_GraphWrapper[P, R]):
    """The monolithic engine: one CUDA graph per batch descriptor.

    ``runtime_mode`` (FULL or PIECEWISE) is the forward-context mode this
    wrapper serves; under any other mode it is a plain call, which lets an
    outer FULL wrapper and inner PIECEWISE wrappers nest. Replay returns the
    outputs captured for the descriptor, the same objects every time (treat
    them, and a list or dict holding them, as read-only); with
    ``weak_ref_output`` they stay valid until the next replay of any graph in
    the same pool.

    Args:
        runnable: what to capture: an instance or a function taking the
            static inputs (a class is refused).
        runtime_mode: FULL or PIECEWISE.
        options: the capture options (``None``: the defaults).

    Raises:
        ValueError: a bad argument, naming it.
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
        super().__init__(runnable, MonolithicRecorder, runtime_mode, runtime_mode, options)

    @property
    def runtime_mode(self) -> CUDAGraphMode:
        return self._recorder.mode


class BreakableCUDAGraphWrapper(_GraphWrapper[P, R]):
    """The breakable engine behind the wrapper contract of ``CUDAGraphWrapper``.

    Captures with a ``BreakableCUDAGraphCapture`` under any forward-context
    mode other than NONE: graph segments split at ``eager_break_during_capture``
    ops, replayed in order with the ops run eagerly between them. An explicit
    ``capture()`` runs the runnable under a PIECEWISE context.

    Args:
        runnable: what to capture: an instance or a function taking the
            static inputs (a class is refused).
        options: the capture options (``None``: the defaults).

    Raises:
        ValueError: a bad argument, naming it.
    """

    __slots__ = ()

    def __init__(self, runnable: Callable[P, R], options: CaptureOptions | None = None) -> None:
        super().__init__(runnable, BreakableRecorder, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, options)

    def capture_for(self, descriptor: BatchDescriptor) -> BreakableCUDAGraphCapture | None:
        """The capture of ``descriptor``'s segments.

        Args:
            descriptor: the graph's key.

        Returns:
            Its ``BreakableCUDAGraphCapture`` (``num_graphs``,
            ``num_eager_breaks``), or ``None`` where none is captured.

        Raises:
            ValueError: ``descriptor`` is no ``BatchDescriptor``.
        """
        check_descriptor(descriptor)
        entry = self._entries.get(descriptor)
        if entry is None:
            return None
        assert isinstance(entry.owner, BreakableCUDAGraphCapture)
        return entry.owner


def _check_addresses(
    descriptor: BatchDescriptor,
    expected: tuple[tuple[str, int], ...],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    """Raise ``ValueError`` naming the first tensor argument that moved since capture."""
    got = addresses_of(args, kwargs)
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

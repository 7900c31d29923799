"""The loop engine: up to ``max_steps`` iterations of a captured step in one launch (``DeviceLoop``).

A decode loop runs its step until every request is done or a step limit is
reached. Driven from the host, every step ends in a read-back of a stop flag
(a host synchronization) and the next launch. ``DeviceLoop`` captures the
step once and, where it can, runs the whole loop on the device:

- ``WHILE``: the body is captured as a torch CUDA graph into the graph pool,
  by torch's own capture (under the device's capture lock, on the capture
  stream, with the cuBLAS workspace rule of ``_segment``), kept as a
  ``cudaGraph_t`` (``keep_graph=True``, never instantiated). ``_conditional``
  then builds a second graph with the driver API: a WHILE node whose body is
  a child-graph clone of that graph followed by a one-thread condition
  kernel. One launch runs the loop with no host synchronization.
  Why not capture the body into the WHILE node's body graph during an outer
  torch capture (the feasibility script's way)? There, torch's capture filter
  does not route the body stream's allocations to the pool (its capture id
  differs), so they would have to be rerouted by hand through private
  allocator calls. Here torch captures the body exactly as it captures every
  other graph, so its memory is the pool's, and the driver only copies nodes.
- ``UNROLLED`` (fallback): a torch graph of ``unroll`` iterations, launched
  until the limit with one read-back of the stop flag per launch (the last
  launch of a loop reads nothing back).
- ``HOST_LOOP`` (fallback): a torch graph of one iteration, replayed, with a
  read-back after each (``unroll=1`` asks for this fallback).

Where WHILE is impossible (``LoopFallback``: no cuda-bindings, an old torch
or driver, NVRTC failing, the driver refusing the graph), the loop falls
back; each reason is logged once per process at WARNING (logger
``cudagraph_capture``) and counted (``loop_fallback_counts()``).

The steps counter: ``steps`` (``[]`` int64, on the device) is 0 when a launch
starts and counts the iterations that ran before ``stop`` was set; the body
reads it as its iteration index. Under WHILE the condition kernel adds 1
after each iteration; in the fallbacks each iteration adds ``stop == 0`` as
it was before the body, so an iteration run after stop (an unrolled graph's
tail) counts nothing, and every kind counts the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import torch

from cudagraph_dispatch import BatchDescriptor, check_int

from ._conditional import (
    ConditionalLoops,
    LoopCells,
    LoopFallback,
    LoopUnavailableError,
    RecordedGraph,
    WhileGraph,
    load_conditional,
)
from ._enabled import check_capture_enabled
from ._errors import CaptureError
from ._gc import collect_before_capture
from ._options import CaptureOptions
from ._pool import capture_lock, capture_stream, shared_pool
from ._segment import THREAD, abort_segment, begin_segment, end_segment, on_side_stream

_LOG: Final = logging.getLogger("cudagraph_capture")
_STOP_DTYPES: Final = (torch.bool, torch.int32)

#: One iteration: the step and its advance, given the ``[]`` int64 iteration index on the device.
LoopBody = Callable[[torch.Tensor], object]


class LoopKind(enum.Enum):
    """How a ``DeviceLoop`` runs its iterations."""

    WHILE = "while"  # one launch: a WHILE conditional node, the condition computed on the device
    UNROLLED = "unrolled"  # launches of `unroll` iterations, the stop flag read back after each
    HOST_LOOP = "host_loop"  # a launch per iteration, the stop flag read back after each


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopSpec:
    """What ``DeviceLoop.capture`` was asked for, checked (``checked``); ``stop`` is a ``[]`` view."""

    body: LoopBody
    stop: torch.Tensor
    max_steps: int
    unroll: int
    kind: LoopKind | None
    descriptor: BatchDescriptor | None

    @staticmethod
    def checked(
        body: object, stop: object, max_steps: object, unroll: object, kind: object, descriptor: object
    ) -> LoopSpec:
        """The spec, or ``ValueError`` naming the first bad argument (nothing is touched)."""
        if not callable(body):
            raise ValueError(f"body: expected a callable taking the steps tensor, got {body!r}")
        if not isinstance(stop, torch.Tensor) or stop.numel() != 1 or stop.dtype not in _STOP_DTYPES:
            shown = (
                f"{stop.dtype} tensor of shape {tuple(stop.shape)}"
                if isinstance(stop, torch.Tensor)
                else stop
            )
            raise ValueError(f"stop: expected a one-element bool or int32 tensor, got {shown!r}")
        limit = check_int("max_steps", max_steps, minimum=1)
        per_launch = check_int("unroll", unroll, minimum=1)
        if kind is not None and not isinstance(kind, LoopKind):
            raise ValueError(f"kind: expected a LoopKind or None, got {kind!r}")
        if descriptor is not None and not isinstance(descriptor, BatchDescriptor):
            raise ValueError(f"descriptor: expected a BatchDescriptor or None, got {descriptor!r}")
        # A view, never a copy: the loop must read the very flag the body writes.
        return LoopSpec(body, stop.view(()), limit, per_launch, kind, descriptor)


class LoopGraphs(Protocol):
    """Where a loop's graphs are recorded: torch CUDA graphs on a device (``TorchGraphs``), or fakes."""

    @property
    def device(self) -> int:
        """The CUDA device index the graphs run on."""
        ...

    def session(self) -> contextlib.AbstractContextManager[None]:
        """Hold what one capture holds (the device's capture lock) while the loop's graphs are recorded."""
        ...

    def warm_up(self, work: Callable[[], object]) -> None:
        """Run ``work`` eagerly before recording (lazy initialization happens here, not in a capture)."""
        ...

    def record(self, work: Callable[[], object], *, instantiate: bool) -> RecordedGraph:
        """Record ``work`` as one graph; ``instantiate``: build its executable too (else only recorded)."""
        ...


class TorchGraphs:
    """Records a loop's torch CUDA graphs the way both engines capture (a ``LoopGraphs``).

    On ``options.stream`` or the device's capture stream, ordered after the
    caller's stream (and the caller's after it), into ``options.pool`` or the
    device's shared pool, under the device's capture lock.
    """

    __slots__ = ("_device", "descriptor", "options", "pool", "stream")

    def __init__(self, options: CaptureOptions, device: int, descriptor: BatchDescriptor | None) -> None:
        self._device: Final = device
        self.options: Final = options
        self.descriptor: Final = descriptor
        self.pool: Final = shared_pool(device) if options.pool is None else options.pool
        self.stream: Final = capture_stream(device) if options.stream is None else options.stream

    @property
    def device(self) -> int:
        return self._device

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with torch.cuda.device(self._device), capture_lock(self._device):
            yield

    def warm_up(self, work: Callable[[], object]) -> None:
        with on_side_stream(self.stream):
            for _ in range(self.options.warmup_runs):
                work()

    def record(self, work: Callable[[], object], *, instantiate: bool) -> torch.cuda.CUDAGraph:
        """One torch graph of ``work`` in the pool; ``CaptureError`` if it recorded no CUDA work."""
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph(keep_graph=True)
        assert graph is not None
        collect_before_capture(self.options.gc_disable)
        try:
            with on_side_stream(self.stream):
                begin_segment(graph, self.pool)  # the capture's GEMMs take their workspace from the pool
                try:
                    work()
                except BaseException:
                    abort_segment(graph, self.pool)
                    raise
                recorded = end_segment(graph, self.pool, self.descriptor)
            if not recorded:
                raise CaptureError("the loop body recorded no CUDA work", self.descriptor)
            if instantiate:
                graph.instantiate()
        except BaseException:
            graph = None  # freed now, under the capture lock, not whenever the traceback goes
            raise
        return graph


class _WhileRun:
    """Launches a WHILE loop graph: the limit written, then the graph, on the current stream."""

    __slots__ = ("body", "graph", "limit")

    def __init__(self, graph: WhileGraph, body: RecordedGraph, limit: torch.Tensor) -> None:
        self.graph: Final = graph
        # The loop's nodes are a clone of the body graph's: they use its pool memory, which
        # stays the graph's only while the torch graph lives. Kept as long as the loop.
        self.body: Final = body
        self.limit: Final = limit

    def __call__(self, max_steps: int) -> None:
        self.limit.fill_(max_steps)  # queued before the launch that reads it (same stream)
        self.graph.launch()  # loop_start resets steps on the device


class _ReplayRun:
    """Replays torch graphs of ``unroll`` iterations (and of one), reading the stop flag back per launch."""

    __slots__ = ("cells", "single", "unroll", "unrolled")

    def __init__(self, unrolled: RecordedGraph, single: RecordedGraph, unroll: int, cells: LoopCells) -> None:
        self.unrolled: Final = unrolled
        self.single: Final = single
        self.unroll: Final = unroll
        self.cells: Final = cells

    def __call__(self, max_steps: int) -> None:
        cells = self.cells
        cells.steps.zero_()  # on the current stream, before the first replay
        full, rest = divmod(max_steps, self.unroll)
        for launch in range(full):
            self.unrolled.replay()
            more = launch < full - 1 or rest > 0
            if more and bool(cells.stop.item()):  # a host synchronization on the current stream
                return
        for _ in range(rest):  # fewer than `unroll`: after stop they run as no-ops and count nothing
            self.single.replay()


_Run = _WhileRun | _ReplayRun


class DeviceLoop:
    """A captured loop: ``launch()`` runs up to ``max_steps`` iterations of the body.

    Built by ``DeviceLoop.capture``. ``kind`` says how it runs (``LoopKind``);
    ``fallback`` and ``fallback_reason`` say why it is not ``WHILE`` when it
    fell back (``None`` when it is, or when ``kind`` was asked for).
    ``steps_taken`` is the device counter of the last launch's iterations
    (``[]`` int64; read it, never write it). Dropping the loop frees its graphs.
    """

    __slots__ = ("_cells", "_run", "descriptor", "fallback", "fallback_reason", "kind", "max_steps")

    def __init__(
        self, spec: LoopSpec, cells: LoopCells, kind: LoopKind, run: _Run, why: LoopUnavailableError | None
    ) -> None:
        self._cells: Final = cells
        self._run: Final = run
        self.kind: Final = kind
        self.max_steps: Final = spec.max_steps
        self.descriptor: Final = spec.descriptor
        self.fallback: Final = None if why is None else why.reason
        self.fallback_reason: Final = None if why is None else str(why)

    @classmethod
    def capture(
        cls,
        body: LoopBody,
        *,
        stop: torch.Tensor,
        max_steps: int,
        unroll: int = 8,
        kind: LoopKind | None = None,
        options: CaptureOptions | None = None,
        descriptor: BatchDescriptor | None = None,
    ) -> DeviceLoop:
        """Capture ``body`` as a loop on ``stop``'s CUDA device; nothing of the loop runs.

        Arguments:
            body: one iteration, called as ``body(steps)`` with the ``[]`` int64
                iteration index (0 first) on the device. Capturable; reads and
                writes only tensors allocated before the capture; sets ``stop``
                once every request is done; draws no random numbers (a WHILE
                launch does not advance torch's generator). Under ``UNROLLED``
                it may run again after setting ``stop``: it must then change
                nothing (masking finished requests is its job).
            stop: a one-element bool or int32 CUDA tensor the body sets; the
                caller clears it before each launch.
            max_steps: the most iterations a launch may run (>= 1).
            unroll: iterations per launch of the ``UNROLLED`` fallback; 1 makes
                the fallback ``HOST_LOOP``.
            kind: ``None`` picks WHILE, falling back; a kind forces it (a
                forced WHILE that cannot be built raises ``CaptureError``).
            options: ``CaptureOptions`` (pool, stream, warm-up runs, gc policy).
            descriptor: the key that errors name.

        The body runs ``options.warmup_runs`` times eagerly before it is
        recorded, so the tensors it writes hold undefined values afterwards:
        refill them (and clear ``stop``) before the first launch. Bad
        arguments raise ``ValueError`` before anything runs; a failed capture
        raises ``CaptureError`` naming ``descriptor`` and keeps nothing.
        """
        spec = LoopSpec.checked(body, stop, max_steps, unroll, kind, descriptor)
        if not spec.stop.is_cuda:
            raise ValueError(f"stop: expected a CUDA tensor, got one on {spec.stop.device}")
        options = CaptureOptions.given(options)
        check_capture_enabled(spec.descriptor)
        if THREAD.breakable is not None:
            raise CaptureError(
                "DeviceLoop: cannot capture inside an active breakable capture", spec.descriptor
            )
        device = spec.stop.device.index
        assert device is not None  # a CUDA tensor's device has an index
        return build_loop(spec, TorchGraphs(options, device, spec.descriptor), load_conditional)

    @property
    def steps_taken(self) -> torch.Tensor:
        """``[]`` int64 on the device: the iterations the last launch ran (valid once it is done)."""
        return self._cells.steps

    def launch(self, max_steps: int | None = None) -> None:
        """Run up to ``max_steps`` iterations (default: the capture's) on the current stream.

        Stops after the iteration that sets ``stop``, or at ``max_steps``; at
        least one iteration runs. ``WHILE`` queues it all without a host
        synchronization; the fallbacks read ``stop`` back once per launch of
        their graph. A value above the capture's ``max_steps`` raises ``ValueError``.
        """
        steps = self.max_steps if max_steps is None else max_steps
        check_int("max_steps", steps, minimum=1, maximum=self.max_steps)
        self._run(steps)


def build_loop(
    spec: LoopSpec, graphs: LoopGraphs, conditional: Callable[[int], ConditionalLoops]
) -> DeviceLoop:
    """The loop of ``spec``: recorded through ``graphs``, its WHILE node built by ``conditional(device)``.

    ``DeviceLoop.capture`` passes torch graphs and ``load_conditional``; tests
    pass fakes. Failures raise ``CaptureError`` naming the descriptor, and
    everything recorded is freed under the session.
    """
    stop = spec.stop
    # Allocated outside the pool and the capture: the loop's own, as long as it lives.
    steps = torch.zeros((), dtype=torch.int64, device=stop.device)
    cells = LoopCells(steps, torch.full((), spec.max_steps, dtype=torch.int64, device=stop.device), stop)
    try:
        with graphs.session():
            kind, run, why = _record_loop(spec, graphs, cells, conditional)
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(
            f"DeviceLoop: capture failed with {type(error).__name__}: {error}", spec.descriptor
        ) from error
    except BaseException as error:  # KeyboardInterrupt, SystemExit: never wrapped, but say where
        if sys.version_info >= (3, 11):
            error.add_note(f"DeviceLoop: interrupted while capturing the loop of {spec.descriptor}")
        raise
    if why is not None:
        _note_fallback(why, kind)
    return DeviceLoop(spec, cells, kind, run, why)


def _record_loop(
    spec: LoopSpec, graphs: LoopGraphs, cells: LoopCells, conditional: Callable[[int], ConditionalLoops]
) -> tuple[LoopKind, _Run, LoopUnavailableError | None]:
    """Record the loop's graphs (inside the session): WHILE first unless a fallback is forced."""
    graphs.warm_up(lambda: spec.body(cells.steps))
    why: LoopUnavailableError | None = None
    if spec.kind in (None, LoopKind.WHILE):
        try:
            return LoopKind.WHILE, _while_run(spec, graphs, cells, conditional), None
        except LoopUnavailableError as error:
            if spec.kind is LoopKind.WHILE:
                raise CaptureError(
                    f"DeviceLoop: WHILE was asked for, and {error}", spec.descriptor
                ) from error
            why = error
    kind = spec.kind or (LoopKind.UNROLLED if spec.unroll > 1 else LoopKind.HOST_LOOP)
    unroll = 1 if kind is LoopKind.HOST_LOOP else min(spec.unroll, spec.max_steps)
    iteration = _counted(spec.body, cells)
    single = graphs.record(iteration, instantiate=True)
    unrolled = single if unroll == 1 else graphs.record(_repeated(iteration, unroll), instantiate=True)
    return kind, _ReplayRun(unrolled, single, unroll, cells), why


def _while_run(
    spec: LoopSpec, graphs: LoopGraphs, cells: LoopCells, conditional: Callable[[int], ConditionalLoops]
) -> _WhileRun:
    """The body recorded alone, and the WHILE graph around it; ``LoopUnavailableError`` where impossible."""
    layer = conditional(graphs.device)  # before recording anything: it may say no at once
    body: RecordedGraph | None = graphs.record(lambda: spec.body(cells.steps), instantiate=False)
    assert body is not None
    try:
        graph = layer.build(body, cells)
    except LoopUnavailableError as error:
        # A copy without the traceback: the original's frames hold the body graph.
        why = LoopUnavailableError(error.reason, error.detail)
    else:
        return _WhileRun(graph, body, cells.limit)
    body = None  # freed now, under the session (the capture lock)
    raise why


def _counted(body: LoopBody, cells: LoopCells) -> Callable[[], None]:
    """One fallback iteration: the body, then ``steps += 1`` if ``stop`` was clear before it."""

    def iteration() -> None:
        running = cells.stop == 0  # [] bool, read before the body may set stop
        body(cells.steps)
        cells.steps.add_(running)

    return iteration


def _repeated(work: Callable[[], None], times: int) -> Callable[[], None]:
    def repeated() -> None:
        for _ in range(times):
            work()

    return repeated


_fallbacks: Final[dict[LoopFallback, int]] = {}
_fallbacks_lock: Final = threading.Lock()


def _note_fallback(why: LoopUnavailableError, kind: LoopKind) -> None:
    """Count a fallback; log its reason the first time this process sees it."""
    with _fallbacks_lock:
        first = why.reason not in _fallbacks
        _fallbacks[why.reason] = _fallbacks.get(why.reason, 0) + 1
    if first:
        _LOG.warning("DeviceLoop: no WHILE loop here, running loops as %s: %s", kind.value, why)


def loop_fallback_counts() -> dict[LoopFallback, int]:
    """How many loops this process captured without WHILE, per reason (a copy)."""
    with _fallbacks_lock:
        return dict(_fallbacks)

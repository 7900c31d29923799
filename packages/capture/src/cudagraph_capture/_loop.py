"""The loop engine: up to ``max_steps`` iterations of a captured step in one launch (``DeviceLoop``).

``DeviceLoop.capture`` captures a decode step once and runs the loop on the
device where it can: ``WHILE``, the body captured by torch into the graph
pool, run by a WHILE conditional node that ``_conditional`` builds with the
driver API around it (one launch, no host synchronization). Where WHILE is
impossible (``LoopFallback``), it falls back to ``UNROLLED`` (a graph of
``unroll`` iterations, the stop flag read back after each launch) or
``HOST_LOOP`` (a graph of one iteration, read back after each), logging
each reason once per process and counting it (``loop_fallback_counts()``).
docs/design.md, "Decode loops", says why the body is captured this way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import torch

from cudagraph_dispatch import BatchDescriptor
from cudagraph_dispatch.lowlevel import check_int

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
from ._errors import CaptureError, capture_failure, invalidated_capture, note_interrupt
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


#: The most iterations one unrolled graph records (``LoopPolicy.unroll``): each is a copy of the body.
MAX_UNROLL: Final = 1024
#: The most iterations a loop may be captured for: its step counter and limit are int64 on the device.
_MAX_STEPS: Final = 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class LoopPolicy:
    """Which kind a ``DeviceLoop`` runs as.

    ``kind``: ``None`` picks ``WHILE``, falling back where it cannot be
    built; a kind forces it (a forced ``WHILE`` that cannot be built makes the
    capture raise ``CaptureError``). ``unroll``: iterations per launch of the
    ``UNROLLED`` fallback, at most ``MAX_UNROLL`` (its graph records the body
    that many times); 1 makes the fallback ``HOST_LOOP`` (a forced
    ``UNROLLED`` takes 2 or more). A bad field raises ``ValueError`` naming it.
    """

    kind: LoopKind | None = None
    unroll: int = 8

    def __post_init__(self) -> None:
        given: object = self.kind  # checked at run time: callers may not be typed
        if given is not None and not isinstance(given, LoopKind):
            raise ValueError(f"kind: expected a LoopKind or None, got {given!r}")
        check_int("unroll", self.unroll, minimum=1, maximum=MAX_UNROLL)
        if given is LoopKind.UNROLLED and self.unroll == 1:  # it would run, and say, UNROLLED as HOST_LOOP
            raise ValueError(
                "unroll: LoopKind.UNROLLED launches graphs of 2 or more iterations "
                "(one per launch is LoopKind.HOST_LOOP), got 1"
            )


_DEFAULT_POLICY: Final = LoopPolicy()


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopSpec:
    """What ``DeviceLoop.capture`` was asked for, checked (``checked``); ``stop`` is a ``[]`` view."""

    body: LoopBody
    stop: torch.Tensor
    max_steps: int
    policy: LoopPolicy
    descriptor: BatchDescriptor | None

    @staticmethod
    def checked(
        body: object, stop: object, max_steps: object, policy: object, descriptor: object
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
        limit = check_int("max_steps", max_steps, minimum=1, maximum=_MAX_STEPS)
        if not isinstance(policy, LoopPolicy):
            raise ValueError(f"policy: expected a LoopPolicy, got {policy!r}")
        if descriptor is not None and not isinstance(descriptor, BatchDescriptor):
            raise ValueError(f"descriptor: expected a BatchDescriptor or None, got {descriptor!r}")
        # A view, never a copy: the loop must read the very flag the body writes.
        return LoopSpec(body, stop.view(()), limit, policy, descriptor)


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
                except Exception as error:
                    if abort_segment(graph, self.pool):
                        raise invalidated_capture("DeviceLoop", error, self.descriptor) from error
                    raise
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
        policy: LoopPolicy = _DEFAULT_POLICY,
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
            policy: which kind runs the loop (``LoopPolicy``: WHILE, falling back).
            options: ``CaptureOptions`` (pool, stream, warm-up runs, gc policy).
            descriptor: the key that errors name.

        The body runs ``options.warmup_runs`` times eagerly before it is
        recorded: refill the tensors it writes (and clear ``stop``) before the
        first launch. Bad arguments raise ``ValueError`` before anything runs;
        a failed capture raises ``CaptureError`` naming ``descriptor``.
        """
        spec = LoopSpec.checked(body, stop, max_steps, policy, descriptor)
        checked = CaptureOptions.given(options)  # every argument checked before the device is
        if not spec.stop.is_cuda:
            raise ValueError(f"stop: expected a CUDA tensor, got one on {spec.stop.device}")
        graphs = TorchGraphs(checked, _capture_device(spec), spec.descriptor)
        return build_loop(spec, graphs, load_conditional)

    @property
    def steps_taken(self) -> torch.Tensor:
        """``[]`` int64 on the device: the iterations the last launch ran (valid once it is done).

        The iterations run before ``stop`` was set, under every kind alike: a
        WHILE loop's condition kernel adds 1 after each iteration; a fallback
        iteration adds ``stop == 0`` as it was before its body, so one that
        runs after stop (an unrolled graph's tail) counts nothing.
        """
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


def _capture_device(spec: LoopSpec) -> int:
    """The CUDA device of ``spec``'s flag, where a loop is captured; ``CaptureError`` if none may start."""
    check_capture_enabled(spec.descriptor)
    if THREAD.breakable is not None:
        raise CaptureError("DeviceLoop: cannot capture inside an active breakable capture", spec.descriptor)
    device = spec.stop.device.index
    assert device is not None  # a CUDA tensor's device has an index
    return device


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
        raise capture_failure("DeviceLoop", error, spec.descriptor) from error
    except BaseException as error:  # KeyboardInterrupt, SystemExit: never wrapped, but say where
        note_interrupt(error, "DeviceLoop", "the loop", spec.descriptor)
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
    if spec.policy.kind in (None, LoopKind.WHILE):
        try:
            return LoopKind.WHILE, _while_run(spec, graphs, cells, conditional), None
        except LoopUnavailableError as error:
            if spec.policy.kind is LoopKind.WHILE:
                raise CaptureError(
                    f"DeviceLoop: WHILE was asked for, and {error}", spec.descriptor
                ) from error
            why = error
    kind = spec.policy.kind or (LoopKind.UNROLLED if spec.policy.unroll > 1 else LoopKind.HOST_LOOP)
    unroll = 1 if kind is LoopKind.HOST_LOOP else min(spec.policy.unroll, spec.max_steps)
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

"""The loop engine: up to ``max_steps`` iterations of a captured step in one launch (``DeviceLoop``).

``DeviceLoop.capture`` captures a decode step once and runs the loop on the
device where it can: ``WHILE``, the body captured by torch into the graph
pool, run by WHILE conditional nodes that ``_conditional`` builds with the
driver API around it (one launch, no host synchronization), ``check_every``
steps an iteration. Where WHILE is impossible (``LoopFallback``), it falls
back to ``UNROLLED`` (a graph of ``unroll`` iterations, the stop flag read
back after each launch) or ``HOST_LOOP`` (a graph of one iteration, read
back after each), logging each reason once per process and counting it
(``loop_fallback_counts()``). ``DeviceLoop.shrinking`` combines the WHILE
loops of one class of keys, captured on shared cells, into a loop that
keeps its live rows in front and runs, each iteration, the smallest body
that holds them, chosen on the device (``LoopRows``). docs/design.md,
"Decode loops", says why the bodies are captured this way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Protocol

import torch

from cudagraph_dispatch import BatchDescriptor
from cudagraph_dispatch.lowlevel import check_int

from ._conditional import (
    MAX_CHOICE_ROWS,
    Choice,
    ConditionalLoops,
    LoopCells,
    LoopFallback,
    LoopPlan,
    LoopUnavailableError,
    RecordedGraph,
    RowTables,
    WhileGraph,
    load_conditional,
    row_layout,
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
#: The most iterations a WHILE loop runs between two checks (each is a clone of the body in its graph).
MAX_CHECK_EVERY: Final = 64


@dataclasses.dataclass(frozen=True, slots=True)
class LoopPolicy:
    """Which kind a ``DeviceLoop`` runs as.

    Args:
        kind: ``None`` picks ``WHILE``, falling back where it cannot be
            built; a kind forces it (a forced ``WHILE`` that cannot be built
            makes the capture raise ``CaptureError``).
        unroll: iterations per launch of the ``UNROLLED`` fallback, at most
            1024 (its graph records the body that many times); 1 makes the
            fallback ``HOST_LOOP`` (a forced ``UNROLLED`` takes 2 or more).
        check_every: the iterations a ``WHILE`` loop runs between two checks
            of ``stop`` and the limit, 1 to 64 (the conditional node's cost,
            paid once per check; the iterations after the one that set
            ``stop`` run masked and count nothing; the limit is never passed).

    Raises:
        ValueError: a bad field, naming it.
    """

    kind: LoopKind | None = None
    unroll: int = 8
    check_every: int = 4

    def __post_init__(self) -> None:
        given: object = self.kind  # checked at run time: callers may not be typed
        if given is not None and not isinstance(given, LoopKind):
            raise ValueError(f"kind: expected a LoopKind or None, got {given!r}")
        check_int("unroll", self.unroll, minimum=1, maximum=MAX_UNROLL)
        check_int("check_every", self.check_every, minimum=1, maximum=MAX_CHECK_EVERY)
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


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LoopRows:
    """What a shrinking loop keeps in order (``DeviceLoop.shrinking``): its rows and their history.

    Checked by ``DeviceLoop.shrinking``, which takes it (``ValueError``
    naming a bad field there).

    Args:
        active: ``[rows]`` bool, at least the largest body's rows, the flags
            the bodies clear as their requests finish; before each launch the
            caller sets the live rows and clears the rest (every row up to
            the largest body's, not only the first body's).
        buffers: every other per-row tensor the bodies read or write from one
            step to the next (inputs, metadata, the step's own state): dim 0
            the row, each row contiguous, at least as many rows; the loop
            moves their rows with the rows it keeps in front.
        history: ``[max_steps, >= rows]`` int64, written by the bodies at row
            ``step`` (a column per row); after a launch each of its rows up
            to the steps taken is in the launch's row order.
        fill: what a row the loop no longer computed at a step reads in
            ``history``.
    """

    active: torch.Tensor
    buffers: Sequence[torch.Tensor]
    history: torch.Tensor
    fill: int = -1


class _WhileRun:
    """Launches a WHILE loop graph: the limit written, then the graph, on the current stream."""

    __slots__ = ("bodies", "graph", "limit")

    def __init__(self, graph: WhileGraph, bodies: tuple[RecordedGraph, ...], limit: torch.Tensor) -> None:
        self.graph: Final = graph
        # The loop's nodes are clones of the body graphs': they use their pool memory, which
        # stays the graphs' only while the torch graphs live. Kept as long as the loop.
        self.bodies: Final = bodies
        self.limit: Final = limit

    def __call__(self, max_steps: int) -> None:
        self.limit.fill_(max_steps)  # queued before the launch that reads it (same stream)
        self.graph.launch()  # loop_begin resets the steps on the device


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

    Built by ``DeviceLoop.capture`` (one body), or ``DeviceLoop.shrinking``
    (one body per row count, the smallest holding the live rows chosen on
    the device each iteration). ``kind`` says how it runs (``LoopKind``);
    ``fallback`` and ``fallback_reason`` say why it is not ``WHILE`` when it
    fell back (``None`` when it is, or when ``kind`` was asked for).
    ``steps_taken`` is the device counter of the last launch's iterations
    (``[]`` int64; read it, never write it). ``sizes``: a shrinking loop's
    row counts, ascending (``()`` for one body); ``choice``: how it chooses
    (``"switch"``, or ``"if_chain"`` where the driver has no SWITCH node;
    ``None`` for one body). Dropping the loop frees its graphs. Not built
    directly: its constructor's arguments are the two classmethods' work.
    """

    __slots__ = (
        "_cells",
        "_policy",
        "_rows",
        "_run",
        "descriptor",
        "fallback",
        "fallback_reason",
        "kind",
        "max_steps",
        "sizes",
    )

    def __init__(
        self,
        spec: LoopSpec,
        cells: LoopCells,
        kind: LoopKind,
        run: _Run,
        why: LoopUnavailableError | None,
        rows: tuple[tuple[int, ...], RowTables] | None = None,
    ) -> None:
        self._cells: Final = cells
        self._run: Final = run
        self._rows: Final = None if rows is None else rows[1]
        self.kind: Final = kind
        self.max_steps: Final = spec.max_steps
        self._policy: Final = spec.policy
        self.descriptor: Final = spec.descriptor
        self.sizes: Final[tuple[int, ...]] = () if rows is None else rows[0]
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
        shared_with: DeviceLoop | None = None,
    ) -> DeviceLoop:
        """Capture ``body`` as a loop on ``stop``'s CUDA device; nothing of the loop runs.

        The body runs ``options.warmup_runs`` times eagerly before it is
        recorded: refill the tensors it writes (and clear ``stop``) before the
        first launch.

        Args:
            body: one iteration, called as ``body(steps)`` with the ``[]`` int64
                iteration index (0 first) on the device. Capturable; reads and
                writes only tensors allocated before the capture; sets ``stop``
                once every request is done; draws no random numbers (a WHILE
                launch does not advance torch's generator). It may run again
                after setting ``stop`` (a WHILE iteration's later steps, an
                ``UNROLLED`` graph's): it must then change nothing (masking
                finished requests is its job); such iterations count nothing.
            stop: a one-element bool or int32 CUDA tensor the body sets; the
                caller clears it before each launch.
            max_steps: the most iterations a launch may run (>= 1).
            policy: which kind runs the loop (``LoopPolicy``: WHILE, falling back).
            options: ``CaptureOptions`` (pool, stream, warm-up runs, gc policy).
            descriptor: the key that errors name (a shrinking loop's sizes are
                its ``num_reqs``).
            shared_with: a loop of the same ``stop`` and ``max_steps`` whose
                device cells (the step counter the body reads) this one
                shares: loops that share them run one at a time, and
                ``DeviceLoop.shrinking`` combines their bodies.

        Returns:
            The loop, of the kind the policy and the machine allow
            (``kind``, ``fallback``).

        Raises:
            ValueError: a bad argument, naming it, before anything runs.
            CaptureError: the capture failed (naming ``descriptor``), or a
                forced kind cannot be built.
        """
        spec = LoopSpec.checked(body, stop, max_steps, policy, descriptor)
        checked = CaptureOptions.given(options)  # every argument checked before the device is
        cells = _shared_cells(spec, shared_with)
        if not spec.stop.is_cuda:
            raise ValueError(f"stop: expected a CUDA tensor, got one on {spec.stop.device}")
        graphs = TorchGraphs(checked, _capture_device(spec), spec.descriptor)
        return build_loop(spec, graphs, load_conditional, cells)

    @classmethod
    def shrinking(cls, loops: Sequence[DeviceLoop], *, rows: LoopRows) -> DeviceLoop:
        """One loop over the bodies of ``loops``, the smallest holding the live rows run each iteration.

        Each iteration starts on the device: the active rows move to the
        front in order (every buffer's rows with them), the smallest body
        that holds them is chosen by a SWITCH node (an IF node per body where
        the driver has no SWITCH), and it runs ``policy.check_every`` steps;
        after the launch, the history is back in the launch's row order.

        Args:
            loops: two or more ``WHILE`` loops (shrinking ones included)
                captured on shared cells (``shared_with``), of one class
                (their descriptors differ in their counts only: ``uniform``,
                ``has_lora`` and ``num_active_loras`` alike), each body's
                rows its descriptor's ``num_reqs``; their graphs stay theirs.
            rows: what the loop keeps in order.

        Returns:
            The shrinking loop (``sizes``, ``choice``).

        Raises:
            ValueError: a bad argument, naming it.
            CaptureError: neither a SWITCH nor IF nodes can be built; the
                loops given still run, each on its own body.
        """
        return shrink_loops(loops, rows, load_conditional)

    @property
    def steps_taken(self) -> torch.Tensor:
        """``[]`` int64 on the device: the iterations the last launch ran (valid once it is done).

        The iterations run before ``stop`` was set, under every kind alike: a
        WHILE loop's kernels count an iteration if ``stop`` was clear before
        it; a fallback iteration adds ``stop == 0`` as it was before its body,
        so one that runs after stop (an unrolled graph's tail) counts nothing.
        """
        return self._cells.steps

    def launch(self, max_steps: int | None = None) -> None:
        """Run up to ``max_steps`` iterations on the current stream.

        Stops after the iteration that sets ``stop``, or at ``max_steps``; at
        least one iteration runs. ``WHILE`` queues it all without a host
        synchronization; the fallbacks read ``stop`` back once per launch of
        their graph.

        Args:
            max_steps: the most iterations, from 1 to the capture's
                ``max_steps`` (``None``: the capture's).

        Raises:
            ValueError: ``max_steps`` out of that range.
        """
        steps = self.max_steps if max_steps is None else max_steps
        check_int("max_steps", steps, minimum=1, maximum=self.max_steps)
        self._run(steps)

    def read_steps(self) -> tuple[int, dict[int, int]]:
        """The last launch's iterations, and a shrinking loop's per body (rows -> iterations, those that ran).

        One host synchronization, for both; ``{}`` for a loop of one body.
        """
        rows = self._rows
        if rows is None:
            return int(self._cells.steps), {}
        values = torch.cat((self._cells.counters[:1], rows.branch_steps)).tolist()
        return values[0], {size: n for size, n in zip(self.sizes, values[1:], strict=True) if n}

    @property
    def choice(self) -> Choice | None:
        run = self._run
        return run.graph.choice if isinstance(run, _WhileRun) else None

    def _bodies(self) -> dict[int, RecordedGraph]:
        """A WHILE loop's bodies by rows (its descriptor's ``num_reqs``; a shrinking loop's ``sizes``)."""
        run = self._run
        if not isinstance(run, _WhileRun):
            return {}
        if self.sizes:
            return dict(zip(self.sizes, run.bodies, strict=True))
        rows = None if self.descriptor is None else self.descriptor.num_reqs
        return {} if rows is None else {rows: run.bodies[0]}


def _shared_cells(spec: LoopSpec, shared_with: object) -> LoopCells | None:
    """The cells of ``shared_with`` (``None``: new); ``ValueError`` unless of ``spec``'s stop and steps."""
    if shared_with is None:
        return None
    if not isinstance(shared_with, DeviceLoop):
        raise ValueError(f"shared_with: expected a DeviceLoop or None, got {shared_with!r:.80}")
    cells = shared_with._cells
    if cells.stop.data_ptr() != spec.stop.data_ptr() or shared_with.max_steps != spec.max_steps:
        raise ValueError(
            "shared_with: a loop shares its cells with loops of the same stop flag and max_steps, "
            f"got one of max_steps={shared_with.max_steps} and another flag"
        )
    return cells


def _capture_device(spec: LoopSpec) -> int:
    """The CUDA device of ``spec``'s flag, where a loop is captured; ``CaptureError`` if none may start."""
    check_capture_enabled(spec.descriptor)
    if THREAD.breakable is not None:
        raise CaptureError("DeviceLoop: cannot capture inside an active breakable capture", spec.descriptor)
    device = spec.stop.device.index
    assert device is not None  # a CUDA tensor's device has an index
    return device


def build_loop(
    spec: LoopSpec,
    graphs: LoopGraphs,
    conditional: Callable[[int], ConditionalLoops],
    cells: LoopCells | None = None,
) -> DeviceLoop:
    """The loop of ``spec``: recorded through ``graphs``, its WHILE nodes built by ``conditional(device)``.

    ``DeviceLoop.capture`` passes torch graphs and ``load_conditional``; tests
    pass fakes. ``cells``: shared ones (``None``: the loop's own). Failures
    raise ``CaptureError`` naming the descriptor, and everything recorded is
    freed under the session.
    """
    # Allocated outside the pool and the capture: the loop's own, as long as it lives.
    cells = LoopCells.new(spec.stop, spec.max_steps) if cells is None else cells
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
        graph = layer.build(LoopPlan((body,), cells, _every(spec), None))
    except LoopUnavailableError as error:
        # A copy without the traceback: the original's frames hold the body graph.
        why = LoopUnavailableError(error.reason, error.detail)
    else:
        return _WhileRun(graph, (body,), cells.limit)
    body = None  # freed now, under the session (the capture lock)
    raise why


def _every(spec: LoopSpec) -> int:
    """The steps of an iteration of the loop's first WHILE node (none above its limit)."""
    return min(spec.policy.check_every, spec.max_steps)


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


# ---------------------------------------------------------------------------
# Shrinking loops: one body per row count, chosen on the device
# ---------------------------------------------------------------------------


def shrink_loops(
    loops: Sequence[DeviceLoop], rows: LoopRows, conditional: Callable[[int], ConditionalLoops]
) -> DeviceLoop:
    """``DeviceLoop.shrinking`` with the layer ``conditional(device)`` (tests pass a fake)."""
    first, bodies = _combined(loops)
    tables = _row_tables(rows, bodies, first._cells)
    cells = first._cells
    spec = LoopSpec(_never, cells.stop, first.max_steps, first._policy, max(loops, key=_rows_of).descriptor)
    plan = LoopPlan(tuple(bodies.values()), cells, _every(spec), tables)
    try:
        graph = conditional(cells.stop.device.index or 0).build(plan)
    except LoopUnavailableError as error:
        raise CaptureError(
            f"DeviceLoop.shrinking: neither a SWITCH node nor IF nodes could be built ({error}); "
            "run the loops of one body",
            spec.descriptor,
        ) from None
    run = _WhileRun(graph, plan.bodies, cells.limit)
    return DeviceLoop(spec, cells, LoopKind.WHILE, run, None, (tuple(bodies), tables))


def _combined(loops: object) -> tuple[DeviceLoop, dict[int, RecordedGraph]]:
    """The first of ``loops`` and all their bodies by rows, ascending; ``ValueError`` naming a bad one."""
    if not isinstance(loops, Sequence) or len(loops) < 2 or not all(isinstance(x, DeviceLoop) for x in loops):
        raise ValueError(f"loops: expected two or more DeviceLoops, got {loops!r:.80}")
    first: DeviceLoop = loops[0]
    bodies: dict[int, RecordedGraph] = {}
    for i, loop in enumerate(loops):
        if loop.kind is not LoopKind.WHILE:
            raise ValueError(
                f"loops[{i}]: a {loop.kind.name} loop ({loop.fallback_reason or 'asked for'}); a shrinking "
                "loop chooses among the bodies of WHILE loops"
            )
        if loop._cells is not first._cells or loop._policy != first._policy:
            raise ValueError(f"loops[{i}]: not captured on the cells and policy of loops[0] (shared_with)")
        if not _same_class(loop.descriptor, first.descriptor):
            raise ValueError(
                f"loops[{i}]: {loop.descriptor} is not of the class of {first.descriptor} (uniform, "
                "has_lora and num_active_loras alike, num_reqs given)"
            )
        for size, body in loop._bodies().items():
            if size in bodies:
                raise ValueError(f"loops[{i}]: a second body of {size} rows")
            bodies[size] = body
    return first, dict(sorted(bodies.items()))


def _same_class(key: BatchDescriptor | None, other: BatchDescriptor | None) -> bool:
    if key is None or other is None or key.num_reqs is None or other.num_reqs is None:
        return False
    return (key.uniform, key.has_lora, key.num_active_loras) == (
        other.uniform,
        other.has_lora,
        other.num_active_loras,
    )


def _rows_of(loop: DeviceLoop) -> int:
    return max(loop._bodies())


def _never(steps: torch.Tensor) -> None:  # a combined loop records nothing: its bodies are recorded
    raise AssertionError("a shrinking loop's bodies were recorded by the loops it combines")


def _row_tables(rows: object, bodies: dict[int, RecordedGraph], cells: LoopCells) -> RowTables:
    """The device tables of a loop over ``bodies`` keeping ``rows``; ``ValueError`` naming a bad field."""
    if not isinstance(rows, LoopRows):
        raise ValueError(f"rows: expected a LoopRows, got {rows!r:.80}")
    count = max(bodies)
    device = cells.stop.device
    if count > MAX_CHOICE_ROWS:
        raise ValueError(f"loops: a shrinking loop keeps at most {MAX_CHOICE_ROWS} rows, got {count}")
    _check_rows("rows.active", rows.active, count, device, torch.bool)
    if not isinstance(rows.buffers, Sequence):
        raise ValueError(f"rows.buffers: expected a sequence of tensors, got {rows.buffers!r:.80}")
    for i, buffer in enumerate(rows.buffers):
        _check_rows(f"rows.buffers[{i}]", buffer, count, device, None)
    history = rows.history
    _check_rows("rows.history", history, 0, device, torch.int64)
    if history.dim() != 2 or history.shape[1] < count or history.stride(1) != 1:
        raise ValueError(
            f"rows.history: expected [max_steps, >= {count}] int64 with contiguous rows, "
            f"got shape {tuple(history.shape)}"
        )
    fill = check_int("rows.fill", rows.fill, minimum=-(1 << 63), maximum=(1 << 63) - 1)
    buffers = tuple(rows.buffers)
    row_bytes = max([4, *(row_layout(b[:count])[2] for b in buffers)])  # the order's rows are 4 bytes
    epochs = count + len(bodies) + 1  # one more only where rows moved (fewer live) or the body changed
    return RowTables(
        sizes=torch.tensor(list(bodies), dtype=torch.int64, device=device),
        active=rows.active[:count],
        buffers=tuple(b[:count] for b in buffers),
        scratch=torch.empty(row_bytes * count, dtype=torch.uint8, device=device),
        order=torch.zeros(count, dtype=torch.int32, device=device),
        orders=torch.zeros(epochs, count, dtype=torch.int32, device=device),
        epoch_steps=torch.zeros(epochs, dtype=torch.int64, device=device),
        epoch_rows=torch.zeros(epochs, dtype=torch.int32, device=device),
        branch_steps=torch.zeros(len(bodies), dtype=torch.int64, device=device),
        history=history[:, :count],
        fill=fill,
    )


def _check_rows(
    name: str, tensor: object, count: int, device: torch.device, dtype: torch.dtype | None
) -> None:
    """``tensor`` has at least ``count`` contiguous rows on ``device`` (of ``dtype``), else ``ValueError``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError(f"{name}: expected a tensor with a row dimension, got {tensor!r:.80}")
    if tensor.device != device or (dtype is not None and tensor.dtype != dtype):
        raise ValueError(
            f"{name}: expected a {dtype or 'tensor'} on {device}, got {tensor.dtype} on {tensor.device}"
        )
    if tensor.shape[0] < count or not tensor[0].is_contiguous():
        raise ValueError(
            f"{name}: expected at least {count} rows, each contiguous, got shape {tuple(tensor.shape)}"
        )


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

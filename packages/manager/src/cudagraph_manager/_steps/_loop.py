"""``run_loop``: many decode steps per call, on the device where its loop is captured, else on the host.

The batch takes the step path's checks (each error naming ``run_loop``), its
route and copy in, then runs the planned graph's captured ``DeviceLoop`` (a
shrinking loop where its class has one: it starts on the batch's key and
moves to smaller ones as requests finish, the tokens back in the caller's
order); without one it loops on the host over the same static buffers (the
one-step graph replayed, or the model run eagerly), reading the stop flag
after each step: the same tokens, slower. A loop on the host is logged once per reason
and counted (``stats.host_loop_steps``, and its replays or eager steps);
``strict`` refuses it, as ``run`` refuses an eager step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Final, Generic

import torch

from cudagraph_capture import DeviceLoop, GraphEntry
from cudagraph_dispatch import Dispatch, EagerReason, ForwardContext
from cudagraph_dispatch.lowlevel import NO_MODES

from .._graphs._loops import iteration, loop_metadata
from .._graphs._table import GraphTable, PlannedGraph
from .._memory._buffers import LoopBuffers, StaticBuffers
from .._parts import ManagerParts
from .._values._batch import StepBatch
from .._values._inputs import RESERVED_NAMES
from .._values._loop import LoopResult, check_loop_steps
from .._values._protocols import CaptureState, OutputT
from ._path import StepPath
from ._plan import NoGraphError

_logger: Final = logging.getLogger("cudagraph_manager")


@dataclasses.dataclass(frozen=True, slots=True)
class LoopRoute(Generic[OutputT]):
    """Where a loop runs: ``loop`` on the device, else on the host over ``entry`` or eagerly.

    ``graph``: the loopable planned graph whose rows the loop runs on
    (``None``: the batch's own rows, eagerly); ``entry``: its one-step graph
    (``None``: each step runs the model eagerly, for ``eager``); ``why``:
    why the loop runs on the host, in words (``""`` on the device).
    """

    graph: PlannedGraph[OutputT] | None
    entry: GraphEntry[OutputT] | None
    loop: DeviceLoop | None
    eager: EagerReason | None
    why: str


class LoopSteps(Generic[OutputT]):
    """A manager's ``run_loop``: a checked uniform batch routed to its planned graph and looped."""

    __slots__ = ("_buffers", "_captures", "_logged", "_parts", "_path", "_table")

    def __init__(
        self,
        parts: ManagerParts[OutputT],
        buffers: LoopBuffers[OutputT],
        table: GraphTable[OutputT],
        path: StepPath[OutputT],
        captures: CaptureState,
    ) -> None:
        self._parts: Final = parts
        self._buffers: Final = buffers
        self._table: Final = table
        self._path: Final = path
        self._captures: Final = captures  # why a planned graph has no entry (released, or not yet)
        self._logged: Final[set[str]] = set()  # the reasons a loop ran on the host, logged once each

    def run(self, given: object, named: Mapping[str, object], max_steps: object) -> LoopResult:
        """Up to ``max_steps`` steps of a uniform batch, ``given`` or ``named`` (checked as ``run`` does).

        Raises ``ValueError`` starting with ``run_loop:`` for a bad argument,
        and ``NoGraphError`` in strict mode where it would loop on the host,
        before a buffer is touched or a step counted.
        """
        batch, steps = self._checked(given, named, max_steps)
        if batch.num_tokens == 0:  # an idle loop: no model call, no step
            self._parts.counts.idle()
            return LoopResult(self._buffers.tokens[:0, :0], 0, None)
        route = self._route(batch)
        context, rows = self._start(batch, route.graph, route.entry)
        loop = route.loop
        if loop is not None:
            loop.launch(steps)
            taken, by_size = loop.read_steps()  # the one synchronization
            by_size = by_size or {rows[0]: taken}
        else:
            taken, by_size = self._host_loop(route.graph, route.entry, context, rows, steps), {}
        self._count(route, taken, batch.num_tokens, by_size)
        tokens = self._buffers.tokens[:taken, : batch.num_reqs]
        return LoopResult(tokens, taken, None if loop is None else loop.kind)

    def _checked(
        self, given: object, named: Mapping[str, object], max_steps: object
    ) -> tuple[StepBatch, int]:
        """The batch of a ``run_loop`` call and its step limit; ``ValueError`` naming a bad argument."""
        inputs = loop_inputs(given, named)
        try:
            steps = check_loop_steps(self._buffers.config, max_steps)
            num_tokens, num_reqs, grad = self._parts.buffers.check(inputs, False)
        except ValueError as error:  # the step's checks say "run:"; these are run_loop's
            raise ValueError(f"run_loop: {str(error).removeprefix('run: ')}") from None
        if num_tokens != num_reqs:
            buffers = self._parts.buffers
            raise ValueError(
                f"run_loop: a decode loop's batch has one token per request; got {num_tokens} tokens "
                f"(input {first_input(buffers, 'tokens')!r}) for {num_reqs} requests "
                f"(input {first_input(buffers, 'reqs')!r})"
            )
        return StepBatch(num_tokens, num_reqs, inputs, True, 0, NO_MODES, grad), steps

    def _route(self, batch: StepBatch) -> LoopRoute[OutputT]:
        """Where ``batch`` loops: its loopable graph's captured loop, or the host (logged; strict raises)."""
        parts = self._parts
        largest = parts.dispatcher.config.capture_sizes.max
        if batch.num_tokens > largest:  # the host loop runs on the static buffers
            raise ValueError(
                f"run_loop: {batch.num_tokens} requests (input {first_input(parts.buffers, 'tokens')!r}): "
                f"a decode loop runs on the static buffers, of at most {largest} tokens (the largest "
                "capture size); split the batch"
            )
        dispatched = parts.dispatcher.route(batch.num_tokens, True, 0, NO_MODES)
        graph = self._table.graphs[dispatched.descriptor] if isinstance(dispatched, Dispatch) else None
        entry = None if graph is None else graph.entry  # read once: a background capture may store it
        if graph is None or not graph.loopable:
            reason = EagerReason.NO_GRAPH_FOR_BATCH if graph is not None else dispatched
            assert isinstance(reason, EagerReason)
            route: LoopRoute[OutputT] = LoopRoute(None, None, None, reason, self._no_loop_graph(batch, graph))
        elif entry is None:
            reason = self._uncaptured()
            route = LoopRoute(graph, None, None, reason, self._why_uncaptured(reason, graph))
        else:
            self._path.check_weights()  # WeightsReplacedError names it, before a buffer is touched
            loop = self._table.loops.get(graph.descriptor)
            route = LoopRoute(graph, entry, loop, None, "" if loop is not None else self._no_loop(graph))
        if route.loop is None:
            self._on_host(batch, route)
        return route

    def _uncaptured(self) -> EagerReason:
        """Why a planned graph has no entry: no CUDA here, released, or not captured (yet)."""
        if self._parts.no_graphs is not None:
            return EagerReason.NO_CUDA
        return EagerReason.RELEASED if self._captures.released else EagerReason.NOT_CAPTURED

    def _why_uncaptured(self, reason: EagerReason, graph: PlannedGraph[OutputT]) -> str:
        """Why ``graph`` has no entry (``reason``), in words."""
        if reason is EagerReason.NO_CUDA:
            return self._parts.no_graphs or "no CUDA graphs on this device"
        if reason is EagerReason.RELEASED:
            return "its graphs were released (release()); capture() brings them and the loops back"
        return f"its FULL graph {graph.descriptor} was not captured yet; capture() captures it and its loop"

    def _no_loop_graph(self, batch: StepBatch, graph: PlannedGraph[OutputT] | None) -> str:
        """Why ``batch`` has no graph a loop is captured beside (``graph``: the one it has), in words."""
        if graph is not None:
            return (
                f"its key {graph.descriptor} is a {graph.mode.name} graph; a decode loop is captured "
                "beside a FULL graph with a request row per token"
            )
        return self._parts.dispatcher.explain(batch.num_tokens, uniform_decode=True)

    def _no_loop(self, graph: PlannedGraph[OutputT]) -> str:
        """Why the captured ``graph`` has no decode loop, in words."""
        device = self._parts.device
        if device.type != "cuda":
            return f"decode loops are captured on a CUDA device only, and the manager's device is {device}"
        if self._captures.running() is not None:
            return f"{graph.descriptor}: a background capture captures one-step graphs; capture() the loops"
        return f"{graph.descriptor} has no decode loop: capture() captures it, or logged why it could not"

    def _on_host(self, batch: StepBatch, route: LoopRoute[OutputT]) -> None:
        """A loop about to run on the host: ``NoGraphError`` if strict, else logged once per reason."""
        if self._parts.strict:
            raise NoGraphError(batch.num_tokens, f"run_loop would loop on the host: {route.why}")
        key = "loop_not_captured" if route.eager is None else route.eager.value
        if key not in self._logged:
            self._logged.add(key)
            level = logging.INFO if route.eager is EagerReason.NO_CUDA else logging.WARNING
            _logger.log(
                level, "run_loop of %d requests loops on the host (%s): %s", batch.num_reqs, key, route.why
            )

    def _count(self, route: LoopRoute[OutputT], taken: int, num_tokens: int, by_size: dict[int, int]) -> None:
        """``taken`` steps of ``route`` for ``num_tokens`` real rows (``by_size``: on the device, by key)."""
        graph = route.graph
        if route.loop is None:
            padding = (0 if graph is None else graph.num_tokens - num_tokens) * taken
        else:  # a shrinking loop pads only on its first key: the others hold fewer live rows
            padding = sum(steps * max(size - num_tokens, 0) for size, steps in by_size.items())
        counts = self._parts.counts
        counts.looped(taken, padding, host=route.loop is None, eager=route.eager, by_size=by_size)
        if route.loop is None and route.entry is not None and graph is not None:
            graph.replayed_steps(taken)  # each step of the host loop replayed the one-step graph

    def _start(
        self, batch: StepBatch, graph: PlannedGraph[OutputT] | None, entry: GraphEntry[OutputT] | None
    ) -> tuple[ForwardContext, tuple[int, int]]:
        """The loop's context (its metadata built first: it may refuse), the batch copied in, state reset.

        Returns the context and the rows the loop runs on: ``graph``'s, else the batch's own.
        """
        if graph is None:
            shape, descriptor = batch.eager_shape(), batch.eager_descriptor()
            rows = (batch.num_tokens, batch.num_reqs)
        else:
            shape = graph.shape if entry is not None else graph.eager_shape
            descriptor, rows = graph.descriptor, (graph.num_tokens, graph.num_reqs)
        context = ForwardContext(shape.mode, descriptor, loop_metadata(self._parts, batch, shape))
        with torch.no_grad():
            self._parts.buffers.copy_in(
                batch.inputs, batch.num_tokens, batch.num_reqs, *rows, batch.requires_grad
            )
            self._buffers.reset(batch.num_reqs)
        return context, rows

    def _host_loop(
        self,
        graph: PlannedGraph[OutputT] | None,
        entry: GraphEntry[OutputT] | None,
        context: ForwardContext,
        rows: tuple[int, int],
        max_steps: int,
    ) -> int:
        """The loop on the host: each step replayed (or run eagerly), advanced, its stop flag read back."""
        inputs = self._parts.buffers.views(*rows) if graph is None else graph.inputs
        buffers = self._buffers
        state = buffers.state(buffers.step, rows[1])
        with torch.no_grad():
            for step in range(max_steps):
                buffers.step.fill_(step)
                if entry is not None:
                    entry.replay()
                output = None if entry is None else entry.output
                iteration(self._parts, inputs, ForwardContext(*context), state, output)
                if bool(buffers.stop):  # the read-back a host loop pays every step
                    return step + 1
        return max_steps


def loop_inputs(given: object, named: Mapping[str, object]) -> Mapping[str, torch.Tensor]:
    """``run_loop``'s inputs: the mapping ``given``, or the keywords ``named``; ``ValueError`` if one is bad.

    ``run``'s own keywords are refused by name: a loop's batch is always
    uniform, without adapters. The tensors themselves are the step's checks'.
    """
    reserved = sorted(RESERVED_NAMES.intersection(named))
    if reserved:
        raise ValueError(
            f"run_loop: {reserved[0]}: not an argument of run_loop (a decode loop's batch is always "
            f"uniform, one token per request, with no active adapters); got {named[reserved[0]]!r:.60}"
        )
    if given is None:
        return named  # type: ignore[return-value]  # the step's checks check each value
    if named:
        raise ValueError("run_loop: batch: pass the inputs as keywords or in one mapping, not both")
    if not isinstance(given, Mapping):
        raise ValueError(
            "run_loop: batch: expected a mapping of input names to tensors (or the inputs as keywords), "
            f"got {_shown(given)}"
        )
    for name in given:
        if not isinstance(name, str):
            raise ValueError(f"run_loop: batch: expected input names (strings) as keys, got {name!r:.60}")
    return given


def _shown(value: object) -> str:
    """``value`` for an error: a tensor by dtype and shape, anything else by type and a short repr."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"


def first_input(buffers: StaticBuffers, rows: str) -> str:
    """The first input whose rows are ``rows`` ("tokens", "reqs"): the one that names their count."""
    return next((b.name for b in buffers.buffers if b.rows == rows), "")
